"""Plain PyTorch FSDP (FULL_SHARD) under ``torchrun --nproc_per_node=2``.

Sharded as polytrain's fsdp backend shards by default: FSDP2 (``fully_shard`` on
every sub-module of at least 100k parameters, then on the root,
``reshard_after_forward=True``), rank 0's weights broadcast before sharding. On the
GPT-2 workload the units are the ``GPT2Block`` modules instead, as polytrain's default
``auto_wrap_policy="auto"`` picks them (tied embedding and LM head in the root).
``--meta-init`` (FSDP2): ranks > 0 build the model on the meta device and receive
rank 0's weights into their shards (:func:`meta_init_fsdp2`), a reference for the
set-up memory of a non-zero rank. ``--version 1``: FSDP1 (``FullyShardedDataParallel``
with size-based auto-wrap at 100k parameters, or the blocks, ``use_orig_params=True``,
CPU device), as ``backend_config={"version": 1}``.

Usage: torchrun --nproc_per_node=2 benchmarks/native/fsdp_native.py --spec JSON --result-dir DIR
       [--version 1 | --meta-init]
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import functools  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy  # noqa: E402
from torch.distributed.fsdp.wrap import (  # noqa: E402
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
)

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import recorder  # noqa: E402

MIN_NUM_PARAMS = 100_000


def shard_fsdp2(module: torch.nn.Module, blocks: tuple[type, ...] = ()) -> torch.nn.Module:
    """``fully_shard`` on each unit (deepest first), then the root.

    Units: the modules of the ``blocks`` classes (GPT-2's ``GPT2Block``: the tied
    embedding and LM head stay in the root), else each sub-module of at least
    MIN_NUM_PARAMS parameters.
    """
    from torch.distributed.fsdp import fully_shard

    if blocks:
        units = [m for m in module.modules() if isinstance(m, blocks)]
    else:
        units = [
            m
            for m in module.modules()
            if m is not module and sum(p.numel() for p in m.parameters()) >= MIN_NUM_PARAMS
        ]
    for unit in reversed(units):
        fully_shard(unit, reshard_after_forward=True)
    return fully_shard(module, reshard_after_forward=True)


def shard_fsdp1(module: torch.nn.Module, blocks: tuple[type, ...] = ()) -> torch.nn.Module:
    """FSDP1: ``FullyShardedDataParallel``, wrapping ``blocks`` or by size."""
    policy = (
        ModuleWrapPolicy(set(blocks))
        if blocks
        else functools.partial(size_based_auto_wrap_policy, min_num_params=MIN_NUM_PARAMS)
    )
    return FullyShardedDataParallel(
        module,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=policy,
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        use_orig_params=True,
    )


def meta_init_fsdp2(task: Any, rank: int) -> torch.nn.Module:
    """FSDP2 without the full model on ranks > 0: torchtitan's way of building a large model.

    Rank 0 builds the real model; the other ranks build it on the meta device (no
    memory), all shard it, the others allocate only their shards (``to_empty``), and
    rank 0's weights are broadcast into the shards (``broadcast_from_rank0``). Same
    weights as the default path; the set-up peak of ranks > 0 is their shard, not the model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if rank == 0:
        module = task.build_model()
        full = module.state_dict()  # the full tensors, kept for the broadcast
    else:
        with torch.device("meta"):
            module = task.build_model()
        full = {}
    model = shard_fsdp2(module, task.block_classes(module))
    if rank != 0:
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    return model


def main() -> None:
    """Train the workload with FSDP and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--version", type=int, choices=(1, 2), default=2)
    parser.add_argument(
        "--meta-init",
        action="store_true",
        help="FSDP2: ranks > 0 build the model on the meta device (a reference for memory)",
    )
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    task = load_task(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.mark("process_group")
    if args.meta_init:
        model = meta_init_fsdp2(task, rank)
    else:
        module = task.build_model()
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)  # FSDP's sync_module_states needs an accelerator
        blocks = task.block_classes(module)
        model = shard_fsdp2(module, blocks) if args.version == 2 else shard_fsdp1(module, blocks)
    optimizer = task.make_optimizer(model)
    loader = task.make_loader(rank, world)
    rec.mark("wrapped")

    def step(batch: object) -> None:
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    task.run(loader, step)
    recorder.write_summary(args.result_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
