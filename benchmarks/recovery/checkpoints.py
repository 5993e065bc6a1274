"""Checkpoints at scale: what saving, loading and recovery cost on a 48M-parameter model.

The model is 12 x Linear(2000, 2000) (48M parameters; with Adam about 580 MB of
fp32 weights and optimizer state), trained by 2 workers on CPU. Modes:

``save`` (per backend, one driver process each): the training stall of one
checkpoint written by the workers, synchronously and asynchronously (snapshot
to host memory, background write, marker last), the background write's time,
the bytes each rank writes, each worker's peak RSS during the save (above its
RSS before), the time to load the directory at 1 and 2 workers, and the same
for today's consolidated path (``state_dict()`` gathered to the driver, one file
written there) in the same run, measured last.

``stall``: training steps with a checkpoint every ``--every`` steps, none / sync
/ async: the extra time per checkpoint as training sees it (the background write
competes with training for the CPU).

``rss``: the driver's peak RSS over a training run with ``max_retries=1``
(epoch-end checkpoints for recovery) against ``max_retries=0``, each in a fresh
driver process.

Usage::

    python benchmarks/run.py checkpoints save --backends ddp,fsdp,deepspeed-2
    python benchmarks/run.py checkpoints stall --backend ddp --steps 12 --every 4
    python benchmarks/run.py checkpoints rss --epochs 3

Every mode prints one JSON line per configuration (and a summary table).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "checkpoints"
LAYERS, WIDTH, SAMPLES, GLOBAL_BATCH = 12, 2000, 64, 16


def model_creator(config: dict):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def data_creator(config: dict):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return DataLoader(
        TensorDataset(x, torch.randn(SAMPLES, WIDTH, generator=g)), batch_size=config["batch_size"]
    )


def optimizer_creator(model, config: dict):
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-5)


def _init_ray() -> None:
    sys.path.insert(0, str(REPO))  # this repository's ``benchmarks``, not fairscale's
    from benchmarks.recovery.workload import init_local_ray

    init_local_ray()


def make_trainer(backend: str, num_workers: int, **kwargs):
    import torch

    from polytrain import TorchTrainer

    name, _, option = backend.partition("-")
    config = {"mode": option} if name == "fairscale" else None
    if name == "deepspeed":
        config = {"stage": int(option or 2)}
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=torch.nn.MSELoss,
        config={"batch_size": GLOBAL_BATCH},
        num_workers=num_workers,
        backend=name,
        backend_config=config,
        **kwargs,
    )


# ------------------------------------------------------------------ workers
def _status_mb(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measured(fn, operator):
    """Worker: run ``fn(operator)``; report its time and this process's peak RSS above the start."""
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM (the peak RSS)
        handle.write("5")
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    result = fn(operator)
    return {
        "result": result,
        "s": time.perf_counter() - start,
        "peak_extra_mb": _status_mb("VmHWM") - before,
    }


def _save(trainer, url: str, asynchronous: bool) -> tuple[float, list[dict]]:
    from polytrain.checkpoint.directory import SaveRequest
    from polytrain.trainer_api.torch.checkpoint import save_operator

    request = SaveRequest(
        url=url,
        header={"framework": "torch", "backend": trainer.backend_name, "world_size": 2, "epoch": 1},
        asynchronous=asynchronous,
    )
    start = time.perf_counter()
    out = trainer.apply_all_operators(
        functools.partial(measured, functools.partial(save_operator, request=request))
    )
    return time.perf_counter() - start, out


def _load_s(backend: str, num_workers: int, url: str) -> float:
    from polytrain.trainer_api.torch.checkpoint import load_operator

    trainer = make_trainer(backend, num_workers)
    try:
        start = time.perf_counter()
        trainer.apply_all_operators(functools.partial(load_operator, url=url))
        return time.perf_counter() - start
    finally:
        trainer.shutdown()


def _consolidated(trainer, path: str) -> dict:
    from polytrain.checkpoint import single_file as ckpt

    start = time.perf_counter()
    state = trainer.state_dict()
    gathered = time.perf_counter() - start
    ckpt.save_checkpoint(state, path)
    return {"consolidated_stall_s": time.perf_counter() - start, "consolidated_gather_s": gathered}


REPS = 3


def _saves(trainer, folder: str) -> dict:
    """REPS synchronous saves, then 1 + REPS asynchronous ones (the first allocates the staging)."""
    from polytrain.trainer_api.checkpointing import worker_writer as checkpoint_worker

    sync_s, async_s, background_s, snapshot_s = [], [], [], []
    sync = started = None
    for rep in range(REPS):
        seconds, sync = _save(trainer, f"{folder}/sync{rep}", asynchronous=False)
        sync_s.append(seconds)
    for rep in range(REPS + 1):
        seconds, started = _save(trainer, f"{folder}/async{rep}", asynchronous=True)
        flush_start = time.perf_counter()
        trainer.apply_all_workers(checkpoint_worker.flush)
        if rep == 0:
            first_async_s = seconds
            continue
        async_s.append(seconds)
        background_s.append(time.perf_counter() - flush_start)
        snapshot_s.append(max(r["result"]["snapshot_s"] for r in started))
    med = statistics.median
    return {
        "sync_stall_s": med(sync_s),
        "async_stall_s": med(async_s),
        "async_over_sync": med(async_s) / med(sync_s),
        "async_first_stall_s": first_async_s,
        "async_snapshot_s": med(snapshot_s),
        "async_background_write_s": med(background_s),
        "bytes_per_rank_mb": [round(r["result"]["bytes"] / 2**20, 1) for r in sync],
        "worker_peak_extra_mb_sync": [round(r["peak_extra_mb"], 1) for r in sync],
        "worker_peak_extra_mb_async": [round(r["peak_extra_mb"], 1) for r in started],
    }


def run_save(backend: str) -> dict:
    """One driver process: sync and async saves, loads, then the consolidated path."""
    import resource

    _init_ray()
    folder = tempfile.mkdtemp(prefix="ckpt-bench-")
    trainer = make_trainer(backend, 2)
    try:
        trainer.train(num_steps=1)
        result = {"backend": backend, **_saves(trainer, folder)}
        result["driver_peak_rss_mb_before_consolidated"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        result.update(_consolidated(trainer, f"{folder}/consolidated.pt"))
        result["driver_peak_rss_mb_after_consolidated"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
    finally:
        trainer.shutdown()
    result["load_s_1_worker"] = _load_s(backend, 1, f"{folder}/sync0")
    result["load_s_2_workers"] = _load_s(backend, 2, f"{folder}/sync0")
    return result


def run_stall(backend: str, steps: int, every: int) -> dict:
    """Time of ``steps`` training steps with no, synchronous and asynchronous checkpoints
    every ``every`` steps; the modes interleaved REPS times, medians compared."""
    from polytrain.trainer_api.checkpointing import worker_writer as checkpoint_worker

    _init_ray()
    folder = tempfile.mkdtemp(prefix="ckpt-bench-")
    trainer = make_trainer(backend, 2)
    result = {"backend": backend, "steps": steps, "every": every}
    try:
        trainer.train(num_steps=2)  # warm-up
        _save(trainer, f"{folder}/warm", asynchronous=True)  # allocates the staging buffers
        trainer.apply_all_workers(checkpoint_worker.flush)
        for rep in range(REPS):
            for mode in ("none", "sync", "async"):
                start = time.perf_counter()
                for step in range(steps):
                    trainer.train(num_steps=1)
                    # no save after the last step: its write would overlap nothing
                    if mode != "none" and (step + 1) % every == 0 and step + 1 < steps:
                        _save(trainer, f"{folder}/{mode}{rep}-{step}", asynchronous=mode == "async")
                trainer.apply_all_workers(checkpoint_worker.flush)
                result.setdefault(f"{mode}_s", []).append(time.perf_counter() - start)
    finally:
        trainer.shutdown()
    base = statistics.median(result["none_s"])
    saves = (steps - 1) // every
    for mode in ("sync", "async"):
        result[f"{mode}_stall_per_checkpoint_s"] = (
            statistics.median(result[f"{mode}_s"]) - base
        ) / saves
    return result


def run_rss(max_retries: int, epochs: int, backend: str) -> dict:
    """One driver process: train ``epochs`` epochs; the driver's peak RSS."""
    import resource

    _init_ray()
    trainer = make_trainer(backend, 2, failure_config={"max_retries": max_retries})
    try:
        paths = [trainer.train().get("checkpoint_path") for _ in range(epochs)]
        point = trainer.recovery.latest  # what a restart would load: a path, not tensors
        recovery = (
            None if point is None else {"path": point.path, "in_memory": point.state is not None}
        )
    finally:
        trainer.shutdown()
    return {
        "backend": backend,
        "max_retries": max_retries,
        "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checkpoint_paths": paths,
        "recovery_point": recovery,
    }


# --------------------------------------------------------------------- main
def _spawn(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *args, "--one"], capture_output=True, text=True, cwd=REPO
    )
    if out.returncode != 0:
        raise RuntimeError(f"run {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the chosen mode's configurations, each in its own driver process (``--one``: this one)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("mode", choices=("save", "stall", "rss"))
    parser.add_argument("--backends", default="ddp,fsdp,deepspeed-2")
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-retries", type=int, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a single configuration in this process
        if args.mode == "save":
            result = run_save(args.backend)
        elif args.mode == "stall":
            result = run_stall(args.backend, args.steps, args.every)
        else:
            result = run_rss(args.max_retries, args.epochs, args.backend)
        print(json.dumps(result))
        return 0
    if args.mode == "save":
        runs = [["save", "--backend", b] for b in args.backends.split(",")]
    elif args.mode == "stall":
        runs = [
            [
                "stall",
                "--backend",
                args.backend,
                "--steps",
                str(args.steps),
                "--every",
                str(args.every),
            ]
        ]
    else:
        runs = [
            [
                "rss",
                "--backend",
                args.backend,
                "--max-retries",
                str(r),
                "--epochs",
                str(args.epochs),
            ]
            for r in (0, 1)
        ]
    for run in runs:
        print(json.dumps(_spawn(run)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
