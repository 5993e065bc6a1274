"""Where a training step's time goes, in a polytrain worker and in the native torchrun script.

For the same step on the benchmark MLP (``--backend``: DeepSpeed ZeRO-2, the
default; fairscale OSS + ShardedDataParallel; FSDP2 ``fully_shard``), both sides
record per step: the wall time, the training thread's CPU time, its voluntary
and involuntary context switches, the time spent in Python's garbage collector,
and (over a separate cProfile window) the Python calls per step and the top
functions. A wall-time gap with equal CPU time and more involuntary context
switches is preemption by other processes (on a small machine: the Ray
runtime's own daemons and threads), not extra work in the step.

The native side builds what the native benchmark script of the backend builds
(``benchmarks/native/deepspeed_native.py``, ``fairscale_native.py``,
``fsdp_native.py``) and runs its step; the polytrain side is a TorchTrainer with
that backend (DeepSpeed: ``{"stage": 2}``; fairscale and fsdp: the default
``backend_config``, i.e. "sddp" and FSDP2) whose operator runs its default step.

Usage (``benchmarks/run.py step-profile`` starts it under torchrun for ``--mode native``)::

    python benchmarks/run.py step-profile --mode native \
        [--backend deepspeed|fairscale|fsdp] --result-dir DIR
    python benchmarks/run.py step-profile --mode polytrain \
        [--backend deepspeed|fairscale|fsdp] --result-dir DIR

which run ``torchrun --nproc_per_node=2 benchmarks/drivers/step_profile.py --mode native
...`` and ``python benchmarks/drivers/step_profile.py --mode polytrain ...`` (with this
repository on ``PYTHONPATH``).

Each rank writes ``DIR/<mode><rank>.json`` (numbers, the backend, the 1-minute load
average before and after the timed steps, and per-function call counts) and
``DIR/<mode><rank>.txt`` (the top of the profile).

``--mode polytrain --ab`` also times, in the same workers, the native script's step
on the operator's own wrapped model and optimizer, in interleaved blocks with the
operator's step (``DIR/ab<rank>.json``): both run under the same load and next to
the same Ray processes, so a CPU-time difference between them is work that the
operator's step adds, and a difference between the two processes is not.
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
import re
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import mlp

STEPS, WARMUP, PROFILED = 250, 50, 100
#: ``--ab``: interleaved blocks of this many steps, per side and round.
AB_ROUNDS, AB_BLOCK = 12, 25
BACKENDS = ("deepspeed", "fairscale", "fsdp")
#: polytrain's ``backend_config`` per backend (None: the backend's defaults).
POLYTRAIN_CONFIGS: dict[str, dict[str, Any] | None] = {
    "deepspeed": {"stage": 2},
    "fairscale": None,  # mode "sddp": OSS + ShardedDataParallel
    "fsdp": None,  # version 2: fully_shard
}
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
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_THREAD)
    for _ in range(STEPS):
        batch = next(batches)
        wall, cpu = time.perf_counter(), time.thread_time()
        step(*batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    load_after = os.getloadavg()[0]
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
        "load_1min_before": load_before,
        "load_1min_after": load_after,
        "calls": _call_counts(stats),
        "profile": text.getvalue(),
    }


#: An object's address in a profile key (``<function f at 0x7f...>``).
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _call_counts(stats: pstats.Stats) -> dict[str, int]:
    """Calls per function over the profiled window, keyed so that both sides' keys compare.

    Object addresses (``<function f at 0x7f...>``) differ between processes and are dropped;
    functions whose keys then coincide are summed.
    """
    counts: dict[str, int] = {}
    for (path, line, name), value in stats.stats.items():
        key = f"{path.split('site-packages/')[-1]}:{line}({_ADDRESS.sub('', name)})"
        counts[key] = counts.get(key, 0) + value[1]
    return counts


def _write(result_dir: str, result: dict[str, Any]) -> None:
    out = Path(result_dir)
    (out / f"{result['tag']}.txt").write_text(result.pop("profile"))
    (out / f"{result['tag']}.json").write_text(json.dumps(result))


def _spec() -> mlp.WorkloadSpec:
    return mlp.WorkloadSpec(steps=WARMUP + STEPS + PROFILED + 5, warmup=0)


def run_native(result_dir: str, backend: str = "deepspeed") -> None:
    """Under torchrun: the native script of ``backend``'s model, optimizer and step, profiled."""
    import torch.distributed as dist

    step = {
        "deepspeed": _native_deepspeed,
        "fairscale": _native_fairscale,
        "fsdp": _native_fsdp,
    }[backend]()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = itertools.cycle(list(mlp.make_loader(_spec(), rank, world)))
    result = profile(step, batches, f"native{rank}")
    _write(result_dir, {**result, "backend": backend})
    dist.destroy_process_group()


def _native_deepspeed() -> Callable[[Any, Any], None]:
    """The native DeepSpeed engine of ``benchmarks/native/deepspeed_native.py`` (ZeRO-2) and its step."""
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    spec = _spec()
    module = mlp.build_model(spec)
    config = {
        "train_batch_size": mlp.GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": mlp.GLOBAL_BATCH // world,
        **DS_CONFIG,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=mlp.make_optimizer(module, spec), config=config
    )
    criterion = torch.nn.CrossEntropyLoss()

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(engine(features), target)
        engine.backward(loss)
        engine.step()
        loss.item()

    return step


def _native_fairscale() -> Callable[[Any, Any], None]:
    """OSS + ShardedDataParallel and the step of ``benchmarks/native/fairscale_native.py``."""
    import inspect

    import torch.distributed as dist
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    from benchmarks.native.task import Task

    task = Task(_spec())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    module = task.build_model()
    # The workload's optimizer class and settings, rebuilt as OSS (as fairscale_native.py does).
    template = task.make_optimizer(torch.nn.Linear(1, 1))
    accepted = inspect.signature(type(template)).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    optimizer = OSS(module.parameters(), optim=type(template), **defaults)
    model = ShardedDataParallel(module, optimizer)
    model.train()

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = task.loss(model, (features, target))
        model.zero_grad()  # OSS.zero_grad() would set grads to None under ShardedDDP
        loss.backward()
        optimizer.step()
        loss.item()

    return step


def _native_fsdp() -> Callable[[Any, Any], None]:
    """FSDP2 sharded and stepped as ``benchmarks/native/fsdp_native.py`` does by default."""
    import torch.distributed as dist

    from benchmarks.native import fsdp_native
    from benchmarks.native.task import Task

    task = Task(_spec())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    module = task.build_model()
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)  # as fsdp_native.py: rank 0's weights
    model = fsdp_native.shard_fsdp2(module, task.block_classes(module))
    optimizer = task.make_optimizer(model)
    model.train()

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = task.loss(model, (features, target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    return step


def _profile_operator(operator: Any, result_dir: str, backend: str) -> None:
    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        operator.train_batch((features, target), {})

    batches = itertools.cycle(list(operator.train_loader))
    result = profile(step, batches, f"polytrain{operator.world_rank}")
    _write(result_dir, {**result, "backend": backend})


def _direct_step(
    operator: Any, backend: str, zero_first: bool = False
) -> Callable[[Any, Any], None]:
    """The native script's step (as in :func:`run_native`) on the operator's wrapped objects.

    ``zero_first``: the gradients are cleared before the forward pass, where the
    operator's step clears them, instead of between forward and backward.
    """
    model, optimizer, criterion = operator.model, operator.optimizer, operator.criterion
    # fairscale_native.py zeroes through ShardedDataParallel, fsdp_native.py the optimizer.
    zeroer = model if backend == "fairscale" else optimizer

    def deepspeed_step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(model(features), target)
        model.backward(loss)
        model.step()
        loss.item()

    def torch_step(features: torch.Tensor, target: torch.Tensor) -> None:
        if zero_first:
            zeroer.zero_grad()
        loss = criterion(model(features), target)
        if not zero_first:
            zeroer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    return deepspeed_step if backend == "deepspeed" else torch_step


def _ab_operator(operator: Any, result_dir: str, backend: str) -> None:
    """Interleaved blocks of the operator's step and the native step; CPU and wall ms per step.

    Sides: ``operator`` (its ``train_batch``), ``direct`` (the native step on the same
    objects) and, but for DeepSpeed (whose engine clears gradients in its step),
    ``direct_zero_first`` (the same with the gradients cleared before the forward pass).
    """

    def operator_step(features: torch.Tensor, target: torch.Tensor) -> None:
        operator.train_batch((features, target), {})

    steps = {"operator": operator_step, "direct": _direct_step(operator, backend)}
    if backend != "deepspeed":
        steps["direct_zero_first"] = _direct_step(operator, backend, zero_first=True)
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    batches = itertools.cycle(list(operator.train_loader))
    for _ in range(WARMUP):
        operator_step(*next(batches))
    load_before = os.getloadavg()[0]
    for index in range(AB_ROUNDS):
        names = list(steps)
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            for _ in range(AB_BLOCK):
                batch = next(batches)
                wall, cpu = time.perf_counter(), time.thread_time()
                steps[name](*batch)
                walls[name].append(time.perf_counter() - wall)
                cpus[name].append(time.thread_time() - cpu)
    result = {
        "backend": backend,
        "steps_per_side": AB_ROUNDS * AB_BLOCK,
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
    }
    for name in steps:
        result[f"{name}_cpu_ms"] = statistics.median(cpus[name]) * 1e3
        result[f"{name}_cpu_mean_ms"] = statistics.mean(cpus[name]) * 1e3
        result[f"{name}_wall_ms"] = statistics.median(walls[name]) * 1e3
    Path(result_dir, f"ab{operator.world_rank}.json").write_text(json.dumps(result))


def run_polytrain(result_dir: str, backend: str = "deepspeed", ab: bool = False) -> None:
    """A TorchTrainer on ``backend``; its operator's default step, profiled in the workers.

    DeepSpeed runs ZeRO-2; fairscale and fsdp their default ``backend_config``
    (OSS + ShardedDataParallel, FSDP2). ``ab``: then also :func:`_ab_operator`.
    """
    from polytrain import TorchTrainer

    spec = _spec()
    trainer = TorchTrainer(
        model_creator=mlp.pt_model_creator,
        data_creator=mlp.pt_data_creator,
        optimizer_creator=mlp.pt_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": mlp.GLOBAL_BATCH, "spec": spec.to_json()},
        num_workers=mlp.NUM_WORKERS,
        num_cpus_per_worker=1,
        backend=backend,
        backend_config=POLYTRAIN_CONFIGS[backend],
    )
    trainer.train(num_steps=5)
    trainer.apply_all_operators(lambda operator: _profile_operator(operator, result_dir, backend))
    if ab:
        trainer.apply_all_operators(lambda operator: _ab_operator(operator, result_dir, backend))
    trainer.shutdown()


def main() -> None:
    """Profile one side and write its per-rank records."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "polytrain"), required=True)
    parser.add_argument("--backend", choices=BACKENDS, default="deepspeed")
    parser.add_argument("--result-dir", required=True)
    parser.add_argument(
        "--ab",
        action="store_true",
        help="polytrain: also time the native step on the operator's objects, interleaved",
    )
    args = parser.parse_args()
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    if args.mode == "native":
        run_native(args.result_dir, args.backend)
    else:
        run_polytrain(args.result_dir, args.backend, ab=args.ab)


if __name__ == "__main__":
    main()
