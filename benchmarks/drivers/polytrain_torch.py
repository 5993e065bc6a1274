"""polytrain's TorchTrainer on the workload: one driver process, as a user runs it.

Timing: ``ray.init`` (the same call the trainer makes when Ray is not running)
is timed on its own, then the trainer's construction, then ``train``. The
workers' :class:`TimedOperator` times the default ``train_batch`` (forward,
loss, zero_grad, backward, step, ``loss.item()``) of every step.

Usage: python benchmarks/drivers/polytrain_torch.py --backend ddp --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks import workload  # noqa: E402
from polytrain import TorchTrainer  # noqa: E402
from polytrain.trainer_api.operator import TrainingOperator  # noqa: E402


class TimedOperator(TrainingOperator):
    """The default training step, timed from the worker's side."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Run the default step and record its duration."""
        start = time.perf_counter()
        metrics = super().train_batch(batch, batch_info)
        workload.RECORDER.record(start, time.perf_counter())
        return metrics


def _summary(operator: TrainingOperator) -> dict[str, Any]:
    return workload.RECORDER.summary(operator.world_rank)


def main() -> None:
    """Start a trainer, train ``spec.steps`` steps in one call, write every rank's record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--backend-config", default="null")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    spec = workload.WorkloadSpec.from_json(args.spec)
    marks = {"script_start": _START, "imported": time.time()}
    from polytrain.launchers.worker_group import ensure_ray

    ensure_ray()
    marks["ray_init_done"] = time.time()
    trainer = TorchTrainer(
        model_creator=workload.pt_model_creator,
        data_creator=workload.pt_data_creator,
        optimizer_creator=workload.pt_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=TimedOperator,
        config={"batch_size": workload.GLOBAL_BATCH, "spec": spec.to_json()},
        num_workers=workload.NUM_WORKERS,
        num_cpus_per_worker=1,
        backend=args.backend,
        backend_config=json.loads(args.backend_config),
    )
    marks["trainer_ready"] = time.time()
    stats = trainer.train(num_steps=spec.steps)
    marks["train_done"] = time.time()
    summaries = trainer.apply_all_operators(_summary)
    trainer.shutdown()
    marks["shutdown_done"] = time.time()
    out = Path(args.result_dir)
    for summary in summaries:
        (out / f"rank{summary['rank']}.json").write_text(json.dumps(summary))
    driver = {"marks": marks, "stats": {k: v for k, v in stats.items() if _plain(v)}}
    (out / "driver.json").write_text(json.dumps(driver))


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


if __name__ == "__main__":
    main()
