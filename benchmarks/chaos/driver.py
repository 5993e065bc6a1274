"""One driver segment of the chaos run (:mod:`benchmarks.chaos.orchestrator` starts one per segment).

Usage::

    python benchmarks/chaos/driver.py --address HEAD --case ddp --run-dir DIR --epochs E \
        [--every-n-steps N] [--hang-timeout-s S] [--step-sleep-s S] [--segment K]

Connects to the (simulated) cluster, builds a TorchTrainer or TFTrainer on the chaos
workload with ``checkpoint_dir=DIR/ckpt`` and ``resume=True`` (a later segment
continues where the previous one stopped) and trains until epoch E. At the end it
writes the consolidated state to ``DIR/final.pt``. A SIGTERM makes ``train()``
checkpoint at the next boundary and raise ``TerminatedError`` (a ``RunStoppedError``):
the segment then exits with its ``exit_code`` (143), and the next segment resumes.
Either way it writes ``DIR/segment_<K>.json``: where it started and stopped, the
trainer's restart and drain counts, and the actors and placement groups of its own job still alive
after ``shutdown()`` (should be none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    # fairscale installs a top-level ``benchmarks`` package: this repository's must win.
    sys.path.insert(0, str(REPO))

from benchmarks.chaos import workload  # noqa: E402
from benchmarks.chaos.cluster import live_actors_and_groups  # noqa: E402
from benchmarks.chaos.schedule import NUM_WORKERS  # noqa: E402


def case_backend(case: str) -> tuple[str, Any]:
    """``(backend name, backend_config)`` of a registry test-case id or a backend name."""
    from polytrain.backends.registry import describe_backends, get_spec, resolve_backend_name

    for spec in describe_backends():
        for test_case in spec.test_cases:
            if test_case.id == case:
                return spec.name, test_case.backend_config
    name = resolve_backend_name(case)
    cases = get_spec(name).test_cases
    return name, cases[0].backend_config if cases else None


def build_trainer(args: argparse.Namespace) -> Any:
    """The trainer of this run, resuming from ``run_dir/ckpt`` when a checkpoint is there."""
    backend, backend_config = case_backend(args.case)
    log_dir = str(Path(args.run_dir) / "logs")
    config = {
        "lr": 0.1,
        "batch_size": workload.GLOBAL_BATCH,
        "chaos_log_dir": log_dir,
        "step_sleep_s": args.step_sleep_s,
    }
    common = {
        "config": config,
        "backend": backend,
        "backend_config": backend_config,
        "scaling_config": {
            "num_workers": NUM_WORKERS,
            "placement_strategy": "SPREAD",
            "start_timeout_s": 120,
        },
        "failure_config": {"max_retries": args.max_retries, "hang_timeout_s": args.hang_timeout_s},
    }
    checkpoint = {
        "checkpoint_dir": str(Path(args.run_dir) / "ckpt"),
        "num_to_keep": 2,
        "resume": True,
    }
    if backend == "mwms":
        from polytrain import TFTrainer

        # TFTrainer's calls are whole epochs: it checkpoints at epoch ends only.
        return TFTrainer(
            model_creator=workload.tf_model_creator,
            data_creator=workload.tf_data_creator,
            checkpoint_config=checkpoint,
            **common,
        )
    import torch

    from polytrain import TorchTrainer

    return TorchTrainer(
        model_creator=workload.torch_model_creator,
        data_creator=workload.torch_data_creator,
        optimizer_creator=workload.torch_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=workload.torch_operator_cls(),
        checkpoint_config={**checkpoint, "every_n_steps": args.every_n_steps},
        **common,
    )


def own_leftovers(wait_s: float = 15.0) -> dict[str, list[str]]:
    """This job's actors that are not dead and placement groups not removed, after up to ``wait_s``."""
    import ray

    return live_actors_and_groups(ray.get_runtime_context().get_job_id(), wait_s)


def main() -> int:
    """Run the segment; returns the exit status (0 done, 143 preempted, 1 failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--case", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--every-n-steps", type=int, default=4)
    parser.add_argument("--hang-timeout-s", type=float, default=8.0)
    parser.add_argument("--max-retries", type=int, default=100)
    parser.add_argument("--step-sleep-s", type=float, default=0.05)
    parser.add_argument("--segment", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("polytrain").setLevel(logging.INFO)
    run_dir = Path(args.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"segment": args.segment, "pid": os.getpid(), "t_start": time.time()}
    out = run_dir / f"segment_{args.segment}.json"
    status = 1
    trainer = None
    try:
        from polytrain.errors import RunStoppedError
        from polytrain.launchers.cluster.connect import ensure_ray

        # The raylets' workers import the workload from this repository: benchmarks/chaos/suite.py
        # put it on the PYTHONPATH the cluster's processes inherit.
        ensure_ray(args.address, timeout_s=60)
        trainer = build_trainer(args)
        record["start"] = [trainer.epoch, trainer.position.epoch_step]
        record["t_ready"] = time.time()
        print(f"start {trainer.epoch} {trainer.position.epoch_step}", flush=True)
        try:
            while trainer.epoch < args.epochs:
                trainer.train()
            trainer.save(run_dir / "final.pt")
            status = 0
        except RunStoppedError as exc:
            record["preempted"] = {"checkpoint": exc.checkpoint_path, "message": str(exc)}
            status = exc.exit_code
        record["stop"] = [trainer.epoch, trainer.position.epoch_step]
        record["num_restarts"] = trainer.num_restarts
        record["num_drains"] = trainer.num_drains
        if not trainer.loop.closed:  # RunStoppedError shut it down already
            trainer.shutdown(release_workers=True)
        record["leftovers"] = own_leftovers()
    except Exception:  # noqa: BLE001 - written for the orchestrator, which reports it
        record["error"] = traceback.format_exc()
        print(record["error"], file=sys.stderr, flush=True)
        if trainer is not None and not trainer.loop.closed:
            try:
                trainer.shutdown(force=True)
            except Exception:  # noqa: BLE001 - the error above is the one reported
                pass
        status = 1
    record["status"] = status
    record["t_end"] = time.time()
    out.write_text(json.dumps(record, indent=1))
    with contextlib.suppress(Exception):  # the job ends cleanly: nothing of it is left to reap
        import ray

        ray.shutdown()
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
