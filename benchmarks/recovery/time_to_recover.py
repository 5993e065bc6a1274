"""Recovery time per backend: a worker SIGKILLed mid-epoch -> the first step after recovery.

Issue 13's benchmark: on the 48M-parameter model (12 x Linear(2000, 2000), Adam,
2 workers, CPU), with ``CheckpointConfig(every_n_steps=N)`` and ``max_retries=1``,
rank 1 kills itself with SIGKILL at a fixed batch of the first epoch. Measured per
backend, each run in its own driver process (a fresh ``ray.init``), the backends
interleaved over the repetitions:

* *cold start*: the ``TorchTrainer(...)`` call to the end of the first training
  step (Ray already running: the same job started on a running cluster);
* *recovery*: the SIGKILL to the end of the first step after it: Ray reports the
  lost actor, the driver stops the group, starts a new one (new actors, imports,
  rendezvous, creators, wrapping), every worker reads its part of the newest
  committed checkpoint directory, and training continues at the next batch;
* *steps lost*: batches trained before the kill and trained again after it
  (goal: at most N).

The goal (issue 13): recovery <= 1.5x the cold start, at most ``every_n_steps``
steps lost. Rank 0 logs every step it ends (epoch, batch, wall time) to a file;
the numbers come from that log and the kill time the dying rank writes.

Usage::

    python benchmarks/run.py recovery --reps 3                            # every torch backend
    python benchmarks/run.py recovery --backends ddp,fsdp --reps 1
    python benchmarks/recovery/time_to_recover.py --one ddp --workdir DIR  # one driver run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    # fairscale installs a top-level ``benchmarks`` package: this repository's must win.
    sys.path.insert(0, str(REPO))

from benchmarks.recovery.workload import (  # noqa: E402
    GLOBAL_BATCH,
    LAYERS,
    WIDTH,
    init_local_ray,
    model_creator,
    optimizer_creator,
)

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "recovery"
BACKEND_CONFIGS: dict[str, dict | None] = {
    "ddp": None,
    "horovod": None,
    "fairscale": {"mode": "sddp"},
    "fsdp": None,
    "deepspeed": {"stage": 2},
}
EVERY_N_STEPS = 2
KILL_AT_BATCH = 5  # of epoch 0: the newest checkpoint then holds batches 0-3, batch 4 is lost


SAMPLES = 8 * GLOBAL_BATCH  # 8 steps an epoch


def data_creator(config: dict):
    """Generated data (fixed seed), SAMPLES rows."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=config["batch_size"])


def _operator_class():
    from polytrain import TrainingOperator

    class StepLog(TrainingOperator):
        """Rank 0 logs each step's end; rank 1 SIGKILLs itself once, at KILL_AT_BATCH."""

        def train_batch(self, batch, batch_info):
            log, marker = self.config["step_log"], self.config["kill_marker"]
            at = (batch_info["epoch_idx"], batch_info["batch_idx"])
            if self.world_rank == 1 and at == (0, KILL_AT_BATCH) and not os.path.exists(marker):
                with open(marker, "w") as handle:
                    handle.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            stats = super().train_batch(batch, batch_info)
            if self.world_rank == 0:
                with open(log, "a") as handle:
                    handle.write(f"{at[0]} {at[1]} {time.time()!r} {os.getpid()}\n")
            return stats

    return StepLog


def run_one(backend: str, workdir: Path) -> dict:
    """One driver: a cold start, a kill at KILL_AT_BATCH, the recovery; the measurements."""
    import ray
    import torch

    from polytrain import TorchTrainer

    init_local_ray(log_to_driver=False)
    log, marker = workdir / "steps.log", workdir / "killed"
    start = time.time()
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=_operator_class(),
        config={"batch_size": GLOBAL_BATCH, "step_log": str(log), "kill_marker": str(marker)},
        num_workers=2,
        backend=backend,
        backend_config=BACKEND_CONFIGS[backend],
        failure_config={"max_retries": 1},
        checkpoint_config={
            "checkpoint_dir": str(workdir / "checkpoints"),
            "every_n_steps": EVERY_N_STEPS,
        },
    )
    try:
        stats = trainer.train()
    finally:
        trainer.shutdown()
        ray.shutdown()
    steps = [line.split() for line in log.read_text().splitlines()]
    killed_at = float(marker.read_text())
    # The first group's rank 0 may end the batch before the kill after the kill time: the
    # recovered group is told apart by its process id.
    before = [s for s in steps if s[3] == steps[0][3]]
    after = [s for s in steps if s[3] != steps[0][3]]
    resumed_at = int(after[0][1])
    return {
        "backend": backend,
        "cold_start_s": float(steps[0][2]) - start,
        "recovery_s": float(after[0][2]) - killed_at,
        "steps_lost": len(before) - resumed_at,
        "resumed_at_batch": resumed_at,
        "steps_before_kill": len(before),
        "num_restarts": stats["num_restarts"],
        "epoch_steps": stats["num_steps"],
    }


def _spawn(backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ptrecovery") as workdir:
        out = subprocess.run(
            [sys.executable, __file__, "--one", backend, "--workdir", workdir],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "POLYTRAIN_WARM_POOL": "0"},
        )
    if out.returncode != 0:
        raise RuntimeError(f"{backend} driver run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(runs: dict[str, list[dict]]) -> str:
    """The markdown table of medians per backend.

    The ratio is taken per run (its cold start and its recovery ran in the same driver,
    seconds apart, so a change of machine load hits both) and its median reported.
    """
    lines = [
        f"{LAYERS} x Linear({WIDTH}, {WIDTH}) (48M parameters), Adam, 2 workers (CPU, gloo), "
        f"every_n_steps={EVERY_N_STEPS}, rank 1 SIGKILLed at batch {KILL_AT_BATCH} of epoch 0",
        "",
        "| backend | cold start (s) | recovery (s) | recovery / cold, per run | median | "
        "steps lost | goal | reps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, results in runs.items():
        if not results:
            continue
        cold = statistics.median(r["cold_start_s"] for r in results)
        recovery = statistics.median(r["recovery_s"] for r in results)
        ratios = [r["recovery_s"] / r["cold_start_s"] for r in results]
        ratio = statistics.median(ratios)
        lost = sorted({r["steps_lost"] for r in results})
        met = ratio <= 1.5 and max(lost) <= EVERY_N_STEPS
        lines.append(
            f"| {backend} | {cold:.2f} | {recovery:.2f} | {', '.join(f'{x:.2f}' for x in ratios)} "
            f"| {ratio:.2f} | {', '.join(map(str, lost))} | {'met' if met else 'missed'} "
            f"| {len(results)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or, with ``--one``, a single driver run)."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--one", default=None, help="backend of one driver run")
    parser.add_argument("--workdir", default=None, help="the one run's directory")
    parser.add_argument("--backends", default=",".join(BACKEND_CONFIGS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--render", default=None, help="print the table of a saved JSON line")
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, Path(args.workdir))))
        return 0
    if args.render is not None:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKEND_CONFIGS))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {sorted(BACKEND_CONFIGS)}")
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    load = [os.getloadavg()[0]]
    for _ in range(args.reps):
        for backend in backends:
            runs[backend].append(_spawn(backend))
            load.append(os.getloadavg()[0])
    print(render(runs))
    print(f"\nload average (1 min) between {min(load):.1f} and {max(load):.1f}")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
