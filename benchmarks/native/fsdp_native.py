"""Plain PyTorch FullyShardedDataParallel (FULL_SHARD) under ``torchrun --nproc_per_node=2``.

Wrapped as polytrain's fsdp backend wraps by default: size-based auto-wrap
(100k parameters), ``use_orig_params=True``, CPU device, rank 0's weights
broadcast before wrapping.

Usage: torchrun --nproc_per_node=2 benchmarks/native/fsdp_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import functools  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy  # noqa: E402
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy  # noqa: E402

from benchmarks import workload  # noqa: E402


def main() -> None:
    """Train the workload with FSDP and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = workload.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    spec = workload.WorkloadSpec.from_json(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.mark("process_group")
    module = workload.build_model(spec)
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)  # FSDP's sync_module_states needs an accelerator
    model = FullyShardedDataParallel(
        module,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=100_000),
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    optimizer = workload.make_optimizer(model, spec)
    criterion = torch.nn.CrossEntropyLoss()
    loader = workload.make_loader(spec, rank, world)
    rec.mark("wrapped")

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    workload.run_steps(loader, step, spec.steps)
    workload.write_summary(args.result_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
