"""Start-up on warm workers: what a second trainer, Lightning call, comparison or Tune trial pays.

Each scenario runs in one driver process, as a user's notebook or script does,
and writes its numbers to ``RESULT_DIR/driver.json`` under ``"metrics"``:

* ``second``: a cold trainer trains and shuts down; then a second trainer of the
  same shape starts in the same process (Ray running). Its first step's end,
  from the constructor call, phase by phase: taking the pooled group, the
  backend's rendezvous on the warm workers, the creators and wrapping, the
  first step.
* ``lightning``: ``pl.Trainer.fit`` then ``trainer.test`` on ``RayStrategy``; each
  call's overhead from the call to its first batch on rank 0.
* ``compare``: :func:`polytrain.compare.runner.compare_backends` over the torch
  backends; the wall time minus the backends' training time, per backend.
* ``tune``: three sequential trials of ``TorchTrainer.as_trainable``; per trial,
  the trial's first iteration minus its training epoch (the trial's start-up),
  and whether its workers were the previous trial's.

Usage: python benchmarks/drivers/polytrain_warm.py --scenario second --spec JSON --result-dir DIR
       [--backend ddp] [--reuse-actors] (tune) [--pool off]
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.drivers.polytrain_torch import (  # noqa: E402
    TimedOperator,
    make_trainer,
    phase_marks,
)
from benchmarks.workloads import mlp, recorder  # noqa: E402

TORCH_BACKENDS = ("ddp", "horovod", "fairscale", "fsdp", "deepspeed")
_BACKEND_CONFIGS = {"deepspeed": {"stage": 2}, "fairscale": {"mode": "sddp"}}


def _first_step(trainer: Any) -> float:
    summaries = trainer.apply_all_operators(lambda op: recorder.RECORDER.summary(op.world_rank))
    return max(s["marks"]["first_step"] for s in summaries)


def _start_and_step(
    backend: str, spec: mlp.WorkloadSpec, prefix: str, num_workers: int = mlp.NUM_WORKERS
) -> dict[str, Any]:
    """Build a trainer, train ``spec.steps`` steps; its start-up phases as seconds from the call."""
    t0 = time.time()
    trainer = make_trainer(backend, _BACKEND_CONFIGS.get(backend), spec, num_workers)
    ready = time.time()
    trainer.train(num_steps=spec.steps)
    first = _first_step(trainer)
    phases = phase_marks(trainer)
    marks = phases["marks"]
    pids = trainer.apply_all_workers(os.getpid)
    trainer.shutdown()
    out = {
        f"{prefix}_first_step_s": first - t0,
        f"{prefix}_construct_s": ready - t0,
        f"{prefix}_group_s": marks["group_ready"] - t0,
        f"{prefix}_rendezvous_s": marks["rendezvous_done"] - marks["group_ready"],
        f"{prefix}_setup_s": marks["setup_done"] - marks["rendezvous_done"],
        f"{prefix}_to_first_step_s": first - ready,
        f"{prefix}_reused": phases["reused"],
    }
    return {"metrics": out, "pids": pids}


def scenario_second(args: argparse.Namespace, spec: mlp.WorkloadSpec) -> dict[str, Any]:
    """A cold trainer, then two more of the same shape in the same process."""
    from polytrain.launchers.cluster.connect import ensure_ray

    ensure_ray()
    cold = _start_and_step(args.backend, spec, "cold")
    second = _start_and_step(args.backend, spec, "second")
    third = _start_and_step(args.backend, spec, "third")
    metrics = {**cold["metrics"], **second["metrics"], **third["metrics"]}
    metrics["same_workers"] = cold["pids"] == second["pids"] == third["pids"]
    return metrics


def scenario_resize(args: argparse.Namespace, spec: mlp.WorkloadSpec) -> dict[str, Any]:
    """Another world size on warm workers: 1 cold worker, grown to 2, then 1 of those 2 again."""
    from polytrain.launchers.cluster.connect import ensure_ray

    ensure_ray()
    cold = _start_and_step(args.backend, spec, "cold1", num_workers=1)
    grown = _start_and_step(args.backend, spec, "grow", num_workers=2)
    shrunk = _start_and_step(args.backend, spec, "shrink", num_workers=1)
    metrics = {**cold["metrics"], **grown["metrics"], **shrunk["metrics"]}
    grown_pids = set(grown["pids"])
    metrics["workers_kept"] = set(cold["pids"]) < grown_pids and set(shrunk["pids"]) < grown_pids
    return metrics


# ------------------------------------------------------------------ Lightning
def _lightning_marks_callback(result_dir: str) -> Any:
    import pytorch_lightning as pl

    class FirstBatch(pl.Callback):
        """Rank 0 writes when each stage's first batch starts, and its pid."""

        def _mark(self, trainer: Any, stage: str) -> None:
            path = Path(result_dir) / f"lightning_{stage}.json"
            if trainer.global_rank == 0 and not path.exists():
                path.write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._mark(trainer, "fit")

        def on_test_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._mark(trainer, "test")

    return FirstBatch()


def scenario_lightning(args: argparse.Namespace, spec: mlp.WorkloadSpec) -> dict[str, Any]:
    """``fit`` then ``test`` on RayStrategy: each call's overhead before its first batch."""
    import pytorch_lightning as pl

    from examples.lightning_mnist import DigitsClassifier, DigitsDataModule
    from polytrain.launchers.cluster.connect import ensure_ray
    from polytrain.lightning import RayStrategy

    ensure_ray()
    trainer = pl.Trainer(
        strategy=RayStrategy(num_workers=mlp.NUM_WORKERS, backend=args.backend),
        max_steps=spec.steps,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[_lightning_marks_callback(args.result_dir)],
    )
    model, data = DigitsClassifier(), DigitsDataModule()
    t_fit = time.time()
    trainer.fit(model, data)
    t_test = time.time()
    trainer.test(model, data)
    t_end = time.time()
    fit = json.loads((Path(args.result_dir) / "lightning_fit.json").read_text())
    test = json.loads((Path(args.result_dir) / "lightning_test.json").read_text())
    return {
        "fit_overhead_s": fit["time"] - t_fit,
        "test_overhead_s": test["time"] - t_test,
        "fit_call_s": t_test - t_fit,
        "test_call_s": t_end - t_test,
        "same_workers": fit["pid"] == test["pid"],
    }


# -------------------------------------------------------------------- compare
def scenario_compare(args: argparse.Namespace, spec: mlp.WorkloadSpec) -> dict[str, Any]:
    """compare_backends over the installed torch backends: overhead per backend."""
    import torch

    import polytrain.compare.runner
    from polytrain.backends.registry import get_spec
    from polytrain.compare.runner import compare_backends
    from polytrain.launchers.cluster.connect import ensure_ray

    report_s = []
    write_results = polytrain.compare.runner.write_results

    def timed_write_results(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return write_results(*args, **kwargs)
        finally:
            report_s.append(time.perf_counter() - start)

    polytrain.compare.runner.write_results = timed_write_results  # the CSV/JSON/PNG report, timed

    ensure_ray()
    names = [b for b in TORCH_BACKENDS if get_spec(b).installed]
    creators = {
        "model_creator": mlp.pt_model_creator,
        "data_creator": mlp.pt_data_creator,
        "optimizer_creator": mlp.pt_optimizer_creator,
        "loss_creator": torch.nn.CrossEntropyLoss,
        "config": {"batch_size": mlp.GLOBAL_BATCH, "spec": spec.to_json()},
        "num_workers": mlp.NUM_WORKERS,
        "num_cpus_per_worker": 1,
    }
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.perf_counter()
        results = compare_backends(creators, names, epochs=1, num_steps=spec.steps, out_dir=out_dir)
        wall = time.perf_counter() - start
    ok = [r for r in results if r.status == "ok"]
    training = sum(sum(r.epoch_times_s) for r in ok)
    metrics: dict[str, Any] = {
        "backends": [r.backend for r in ok],
        "failed": {r.backend: r.reason for r in results if r.status != "ok"},
        "wall_s": wall,
        "training_s": training,
        "overhead_per_backend_s": (wall - training) / max(len(ok), 1),
        "report_s": sum(report_s),
        "overhead_excl_report_per_backend_s": (wall - training - sum(report_s)) / max(len(ok), 1),
    }
    for r in ok:
        metrics[f"startup_s:{r.backend}"] = r.startup_s
    return metrics


# ----------------------------------------------------------------------- tune
def scenario_tune(args: argparse.Namespace, spec: mlp.WorkloadSpec) -> dict[str, Any]:
    """Three sequential trials: each one's start-up, and whether it kept the last one's workers."""
    import ray
    import torch
    from ray import tune

    from polytrain import TorchTrainer

    # Logical CPUs: a trial holds 1 for the trainable and 1 per worker.
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    trainable = TorchTrainer.as_trainable(
        model_creator=mlp.pt_model_creator,
        data_creator=mlp.pt_data_creator,
        optimizer_creator=mlp.pt_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=PidOperator,
        config={"batch_size": mlp.GLOBAL_BATCH, "spec": spec.to_json()},
        num_workers=mlp.NUM_WORKERS,
        num_epochs=1,
        num_steps=spec.steps,
        validate=False,
    )
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable,
            param_space={"lr": tune.grid_search([1e-3, 2e-3, 3e-3])},
            tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=args.reuse_actors),
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        )
        start = time.perf_counter()
        grid = tuner.fit()
        wall = time.perf_counter() - start
    frames = [r.metrics for r in grid]
    startups = [f["time_this_iter_s"] - f["epoch_time_s"] for f in frames]
    pids = [f.get("worker_pid") for f in frames]
    return {
        "reuse_actors": args.reuse_actors,
        "trial_startup_s": startups,
        "trial_startup_median_s": statistics.median(startups),
        "workers_kept": sum(a == b for a, b in zip(pids, pids[1:], strict=False)),
        "wall_s": wall,
    }


class PidOperator(TimedOperator):
    """Reports the mean worker pid: equal between two trials when they ran on the same workers."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """The timed default step, plus this worker's pid."""
        return {**super().train_batch(batch, batch_info), "worker_pid": os.getpid()}


SCENARIOS = {
    "second": scenario_second,
    "resize": scenario_resize,
    "lightning": scenario_lightning,
    "compare": scenario_compare,
    "tune": scenario_tune,
}


def main() -> None:
    """Run one scenario and write its metrics."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--reuse-actors", action="store_true")
    parser.add_argument("--pool", choices=("on", "off"), default="on")
    args = parser.parse_args()
    if args.pool == "off":
        os.environ["POLYTRAIN_WARM_POOL"] = "0"
    spec = mlp.WorkloadSpec.from_json(args.spec)
    metrics = SCENARIOS[args.scenario](args, spec)
    driver = {"marks": {"script_start": _START, "done": time.time()}, "metrics": metrics}
    (Path(args.result_dir) / "driver.json").write_text(json.dumps(driver))


if __name__ == "__main__":
    main()
