"""polytrain's TorchTrainer on the workload: one driver process, as a user runs it.

Timing: ``ray.init`` (the same call the trainer makes when Ray is not running)
is timed on its own, then the trainer's construction phase by phase (the
worker group's placement and actor start, the backend's rendezvous, the
creators and wrapping: :func:`phase_marks`), then ``train``. The workers'
:class:`TimedOperator` times the default ``train_batch`` (forward, loss,
zero_grad, backward, step, ``loss.item()``) of every step.

Usage: python benchmarks/drivers/polytrain_torch.py --backend ddp --spec JSON --result-dir DIR
       [--preload none|torch,torch.distributed,torch._dynamo]
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import gpt2, mlp, recorder  # noqa: E402
from polytrain import TorchTrainer  # noqa: E402
from polytrain.launchers.worker import STARTUP  # noqa: E402
from polytrain.trainer_api.torch.operator import TrainingOperator  # noqa: E402


class TimedOperator(TrainingOperator):
    """The default training step, timed from the worker's side."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Run the default step and record its duration (the first marks the set-up's end)."""
        recorder.RECORDER.setup_done()  # no-op after the first call
        start = time.perf_counter()
        metrics = super().train_batch(batch, batch_info)
        recorder.RECORDER.record(start, time.perf_counter())
        return metrics


def _summary(operator: TrainingOperator) -> dict[str, Any]:
    return recorder.RECORDER.summary(operator.world_rank)


class PhaseTrainer(TorchTrainer):
    """A TorchTrainer that marks the end of the rendezvous and of the workers' set-up."""

    marks: dict[str, float] = {}

    def setup_workers(self, group: Any) -> None:
        """The run loop's set-up hook, called once the backend connected the workers."""
        PhaseTrainer.marks.setdefault("rendezvous_done", time.time())
        super().setup_workers(group)
        PhaseTrainer.marks.setdefault("setup_done", time.time())


def _startup() -> dict[str, float]:
    return dict(STARTUP)


def phase_marks(trainer: TorchTrainer) -> dict[str, Any]:
    """Driver and worker marks of the trainer's start (wall-clock), and the pre-import times."""
    group = trainer._group
    marks = {f"group_{k}": v for k, v in getattr(group, "timings", {}).items()}
    marks.update(PhaseTrainer.marks)
    PhaseTrainer.marks = {}
    startups = trainer.apply_all_workers(_startup)
    for key in ("actor_init", "preload_done"):
        values = [s[key] for s in startups if key in s]
        if values:
            marks[f"worker_{key}"] = max(values)
    imports = {k: max(s.get(k, 0.0) for s in startups) for s in startups for k in s if ":" in k}
    return {"marks": marks, "imports_s": imports, "reused": bool(getattr(group, "reused", False))}


def make_trainer(
    backend: str,
    backend_config: Any,
    spec: mlp.WorkloadSpec | gpt2.LMSpec,
    num_workers: int = mlp.NUM_WORKERS,
) -> TorchTrainer:
    """The benchmark's trainer (timed operator, phase marks) on ``backend``.

    The GPT-2 workload (an :class:`LMSpec`) has no ``loss_creator``: the default step
    takes the model's own loss from its mapping batches, as a user's LM run does.
    """
    lm = isinstance(spec, gpt2.LMSpec)
    module: Any = gpt2 if lm else mlp
    batch = spec.batch * num_workers if lm else mlp.GLOBAL_BATCH
    return PhaseTrainer(
        model_creator=module.pt_model_creator,
        data_creator=module.pt_data_creator,
        optimizer_creator=module.pt_optimizer_creator,
        loss_creator=None if lm else torch.nn.CrossEntropyLoss,
        training_operator_cls=TimedOperator,
        config={"batch_size": batch, "spec": spec.to_json()},
        num_workers=num_workers,
        num_cpus_per_worker=1,
        backend=backend,
        backend_config=backend_config,
    )


def main() -> None:
    """Start a trainer, train ``spec.steps`` steps in one call, write every rank's record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--backend-config", default="null")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument(
        "--preload",
        default="",
        help="modules new workers pre-import (none: none; default: the backend's)",
    )
    args = parser.parse_args()
    if args.preload:
        from polytrain.launchers.pool import warm_pool as pool

        pool.configure(preload=[] if args.preload == "none" else args.preload.split(","))
    spec = load_task(args.spec).spec
    marks = {"script_start": _START, "imported": time.time()}
    from polytrain.launchers.cluster.connect import ensure_ray

    ensure_ray()
    marks["ray_init_done"] = time.time()
    marks["trainer_start"] = time.time()
    trainer = make_trainer(args.backend, json.loads(args.backend_config), spec)
    marks["trainer_ready"] = time.time()
    stats = trainer.train(num_steps=spec.steps)
    marks["train_done"] = time.time()
    summaries = trainer.apply_all_operators(_summary)
    phases = phase_marks(trainer)
    marks.update(phases.pop("marks"))
    trainer.shutdown()
    marks["shutdown_done"] = time.time()
    out = Path(args.result_dir)
    for summary in summaries:
        (out / f"rank{summary['rank']}.json").write_text(json.dumps(summary))
    driver = {"marks": marks, "stats": {k: v for k, v in stats.items() if _plain(v)}, **phases}
    (out / "driver.json").write_text(json.dumps(driver))


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


if __name__ == "__main__":
    main()
