"""Where a training step's time goes, in a polytrain worker and in the native torchrun script.

For the same DeepSpeed ZeRO-2 step (or DDP) on the benchmark MLP, both sides
record per step: the wall time, the training thread's CPU time, its voluntary
and involuntary context switches, the time spent in Python's garbage collector,
and (over a separate cProfile window) the Python calls per step and the top
functions. A wall-time gap with equal CPU time and more involuntary context
switches is preemption by other processes (on a small machine: the Ray
runtime's own daemons and threads), not extra work in the step.

Usage::

    torchrun --nproc_per_node=2 benchmarks/drivers/step_profile.py --mode native --result-dir DIR
    python benchmarks/drivers/step_profile.py --mode polytrain --result-dir DIR

Each rank writes ``DIR/<mode><rank>.json`` (numbers and per-function call counts)
and ``DIR/<mode><rank>.txt`` (the top of the profile).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import workload

STEPS, WARMUP, PROFILED = 250, 50, 100
DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 2**31 - 1,
}


class _GCTimer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def profile(step: Callable[[Any, Any], None], batches: Iterator, tag: str) -> dict[str, Any]:
    """Time ``STEPS`` steps after ``WARMUP``, then profile ``PROFILED`` more; the numbers."""
    for _ in range(WARMUP):
        step(*next(batches))
    timer = _GCTimer()
    walls, cpus = [], []
    before = resource.getrusage(resource.RUSAGE_THREAD)
    for _ in range(STEPS):
        batch = next(batches)
        wall, cpu = time.perf_counter(), time.thread_time()
        step(*batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILED):
        step(*next(batches))
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(30)
    return {
        "tag": tag,
        "wall_ms": statistics.median(walls) * 1e3,
        "cpu_ms": statistics.median(cpus) * 1e3,
        "involuntary_switches_per_step": (after.ru_nivcsw - before.ru_nivcsw) / STEPS,
        "voluntary_switches_per_step": (after.ru_nvcsw - before.ru_nvcsw) / STEPS,
        "gc_ms_per_step": timer.seconds / STEPS * 1e3,
        "python_calls_per_step": sum(v[1] for v in stats.stats.values()) / PROFILED,
        "python_threads": threading.active_count(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "calls": {
            f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})": v[1]
            for k, v in stats.stats.items()
        },
        "profile": text.getvalue(),
    }


def _write(result_dir: str, result: dict[str, Any]) -> None:
    out = Path(result_dir)
    (out / f"{result['tag']}.txt").write_text(result.pop("profile"))
    (out / f"{result['tag']}.json").write_text(json.dumps(result))


def _spec() -> workload.WorkloadSpec:
    return workload.WorkloadSpec(steps=WARMUP + STEPS + PROFILED + 5, warmup=0)


def run_native(result_dir: str) -> None:
    """Under torchrun: the native DeepSpeed engine of ``benchmarks/native/deepspeed_native.py``."""
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = _spec()
    module = workload.build_model(spec)
    config = {
        "train_batch_size": workload.GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": workload.GLOBAL_BATCH // world,
        **DS_CONFIG,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=workload.make_optimizer(module, spec), config=config
    )
    criterion = torch.nn.CrossEntropyLoss()

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(engine(features), target)
        engine.backward(loss)
        engine.step()
        loss.item()

    batches = itertools.cycle(list(workload.make_loader(spec, rank, world)))
    _write(result_dir, profile(step, batches, f"native{rank}"))
    dist.destroy_process_group()


def _profile_operator(operator: Any, result_dir: str) -> None:
    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        operator.train_batch((features, target), {})

    batches = itertools.cycle(list(operator.train_loader))
    _write(result_dir, profile(step, batches, f"polytrain{operator.world_rank}"))


def run_polytrain(result_dir: str) -> None:
    """A TorchTrainer on DeepSpeed ZeRO-2; its operator's default step, profiled in the workers."""
    from polytrain import TorchTrainer

    spec = _spec()
    trainer = TorchTrainer(
        model_creator=workload.pt_model_creator,
        data_creator=workload.pt_data_creator,
        optimizer_creator=workload.pt_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": workload.GLOBAL_BATCH, "spec": spec.to_json()},
        num_workers=workload.NUM_WORKERS,
        num_cpus_per_worker=1,
        backend="deepspeed",
        backend_config={"stage": 2},
    )
    trainer.train(num_steps=5)
    trainer.apply_all_operators(lambda operator: _profile_operator(operator, result_dir))
    trainer.shutdown()


def main() -> None:
    """Profile one side and write its per-rank records."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "polytrain"), required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    (run_native if args.mode == "native" else run_polytrain)(args.result_dir)


if __name__ == "__main__":
    main()
