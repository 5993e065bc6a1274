"""What keeping a recovery state costs: TorchTrainer with max_retries=0 against max_retries=3.

With retries on, every epoch end captures the consolidated training state (model
and optimizer) so that a lost worker can be replaced. This script measures what
that costs on a model whose optimizer state is large: 12 x Linear(2000, 2000)
(48M parameters, about 580 MB of fp32 model + Adam state), 2 workers, Adam,
the ``ddp`` backend on CPU.

Every configuration runs in its own driver process (a fresh ``ray.init``), so the
driver's peak resident memory (``ru_maxrss``) belongs to that configuration
alone; the configurations are interleaved over the repetitions so that a change
in machine load hits them alike.

Usage::

    python benchmarks/run.py recovery-cost                      # max_retries 0 vs 3, 2 repetitions
    python benchmarks/run.py recovery-cost --reps 3 --epochs 4
    python benchmarks/recovery/driver_cost.py --one 3           # one driver run (what the others spawn)

Reported per configuration (medians over the repetitions): the driver's peak RSS
and its RSS growth over the training run, the wall time of one ``train()``
(epochs after the first, which carries the warm-up), the worker's own epoch
time (``epoch_time_s``: the training loop alone), and the state capture at the
epoch end (``profile["capture_s"]``: consolidating the state and, on one node,
rank 0 writing it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    # fairscale installs a top-level ``benchmarks`` package: this repository's must win.
    sys.path.insert(0, str(REPO))

from benchmarks.recovery import workload  # noqa: E402

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "recovery-cost"
SAMPLES = 256  # 4 steps an epoch: the capture is a visible share of it


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def data_creator(config: dict):
    """Generated data (fixed seed), SAMPLES rows."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, workload.WIDTH, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=config["batch_size"])


def run_one(max_retries: int, epochs: int) -> dict:
    """One driver run: train ``epochs`` epochs; return the measurements."""
    import ray
    import torch

    from polytrain import TorchTrainer

    workload.init_local_ray()
    trainer = TorchTrainer(
        model_creator=workload.model_creator,
        data_creator=data_creator,
        optimizer_creator=workload.optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": workload.GLOBAL_BATCH},
        num_workers=2,
        failure_config={"max_retries": max_retries},
    )
    rss_start = _rss_mb()
    train_s, epoch_s, capture_s = [], [], []
    try:
        for _ in range(epochs):
            start = time.perf_counter()
            stats = trainer.train(profile=True)
            train_s.append(time.perf_counter() - start)
            epoch_s.append(stats["epoch_time_s"])
            capture_s.append(stats["profile"].get("capture_s", 0.0))
    finally:
        trainer.shutdown()
        ray.shutdown()
    return {
        "max_retries": max_retries,
        "driver_peak_rss_mb": _peak_rss_mb(),
        "driver_rss_growth_mb": _rss_mb() - rss_start,
        "train_call_s": train_s[1:] or train_s,
        "worker_epoch_s": epoch_s[1:] or epoch_s,
        "capture_s": capture_s[1:] or capture_s,
    }


def _spawn(max_retries: int, epochs: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(max_retries), "--epochs", str(epochs)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"driver run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or, with ``--one``, a single driver run)."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--one", type=int, default=None, help="max_retries of one driver run")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--retries", default="0,3", help="the max_retries values to compare")
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.epochs)))
        return 0
    values = [int(v) for v in args.retries.split(",")]
    runs: dict[int, list[dict]] = {v: [] for v in values}
    for _ in range(args.reps):
        for value in values:
            runs[value].append(_spawn(value, args.epochs))
    print(
        f"{workload.LAYERS} x Linear({workload.WIDTH}, {workload.WIDTH}), Adam, 2 workers (ddp, CPU), "
        f"{SAMPLES // workload.GLOBAL_BATCH} steps an epoch, {args.reps} reps, medians"
    )
    print(
        "| max_retries | driver peak RSS (MiB) | driver RSS growth (MiB) | "
        "train() call (s) | worker epoch (s) | state capture (s) |"
    )
    print("|---|---|---|---|---|---|")
    for value, results in runs.items():

        def med(key: str, results: list[dict] = results) -> float:
            items = [r[key] for r in results]
            flat = [x for item in items for x in (item if isinstance(item, list) else [item])]
            return statistics.median(flat)

        print(
            f"| {value} | {med('driver_peak_rss_mb'):.0f} | {med('driver_rss_growth_mb'):.0f} "
            f"| {med('train_call_s'):.2f} | {med('worker_epoch_s'):.2f} "
            f"| {med('capture_s'):.2f} |"
        )
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
