"""polytrain's TFTrainer on the Keras MLP: one driver process, as a user runs it.

TFTrainer takes no Keras callbacks, so the benchmark times the steps through
the progress reports its own callback makes after every batch
(``on_train_batch_end``): :func:`_install_step_hook` wraps the worker's
``report_progress`` before training. The native script records the same event
with its own callback.

Usage: python benchmarks/drivers/polytrain_tf.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from benchmarks.workloads import mlp, recorder  # noqa: E402
from polytrain import TFTrainer  # noqa: E402


def model_creator(config: dict[str, Any]) -> Any:
    """TFTrainer ``model_creator``."""
    return mlp.tf_build_model(mlp.spec_from_config(config))


def data_creator(config: dict[str, Any]) -> Any:
    """TFTrainer ``data_creator``: batched with the global batch."""
    return mlp.tf_dataset(mlp.spec_from_config(config))


def _install_step_hook() -> None:
    from polytrain.trainer_api.tensorflow import worker as tf_worker

    original = tf_worker.report_progress
    last = [time.perf_counter()]

    def report_progress(step: int, total: Any = None, phase: str = "train", **kw: Any) -> None:
        now = time.perf_counter()
        if phase == "train" and step > 0:
            recorder.RECORDER.record(last[0], now)
        last[0] = now
        original(step, total, phase=phase, **kw)

    tf_worker.report_progress = report_progress


def _restart_steps() -> None:
    recorder.RECORDER.restart_steps()


def _summary(rank_holder: Any = None) -> dict[str, Any]:
    import json as _json

    index = _json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    return recorder.RECORDER.summary(index)


def main() -> None:
    """Start a TFTrainer, train ``spec.steps`` steps in one call, write every rank's record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    spec = mlp.WorkloadSpec.from_json(args.spec)
    marks = {"script_start": _START, "imported": time.time()}
    from polytrain.launchers.worker_group import ensure_ray

    ensure_ray()
    marks["ray_init_done"] = time.time()
    trainer = TFTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        config={"batch_size": mlp.GLOBAL_BATCH, "spec": spec.to_json()},
        num_workers=mlp.NUM_WORKERS,
        num_cpus_per_worker=1,
    )
    marks["trainer_ready"] = time.time()
    trainer.apply_all_workers(_install_step_hook)
    # One train() call per epoch, as a user runs TFTrainer; the steps of the last
    # epoch are the steady state the native script also reports (mlp.TF_EPOCHS).
    for epoch in range(mlp.TF_EPOCHS):
        if epoch > 0:
            trainer.apply_all_workers(_restart_steps)
        stats = trainer.train(num_steps=spec.steps)
    marks["train_done"] = time.time()
    summaries = trainer.apply_all_workers(_summary)
    trainer.shutdown()
    out = Path(args.result_dir)
    for summary in summaries:
        (out / f"rank{summary['rank']}.json").write_text(json.dumps(summary))
    plain = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}
    (out / "driver.json").write_text(json.dumps({"marks": marks, "stats": plain}))


if __name__ == "__main__":
    main()
