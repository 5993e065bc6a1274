"""ZeRO-3 set-up without a full model per worker (``init_on_rank0``).

Every rank calls ``model_creator`` inside ``deepspeed.zero.Init``: each module's
parameters are partitioned as soon as the module is built, so no rank holds the
full parameters. Initialisation done after a module's constructor (HF's
``post_init``, a creator's own ``model.apply(init_fn)``) would then touch empty
partitions and be lost, so rank 0 also runs the creator outside ``zero.Init``, as
today, and its weights are copied into the partitions module by module
(``GatheredParameters(modifier_rank=0)``: one module's parameters gathered at a
time). The weights equal those of the path without ``zero.Init``, where DeepSpeed
broadcasts rank 0's parameters before partitioning them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from polytrain.backends.core import meta_init, pretrained_fill
from polytrain.backends.core.context import WorkerContext
from polytrain.compat.allocator import large_blocks_mapped
from polytrain.hf.loading import building

#: How a user turns it off (named in errors).
INIT_ON_RANK0_OFF = 'backend_config={"init_on_rank0": False}'


def build_partitioned(
    create: Callable[[], Sequence[torch.nn.Module]],
    ctx: WorkerContext,
    ds_config: dict[str, Any],
    deepspeed: Any,
) -> Sequence[torch.nn.Module]:
    """Worker (every rank, collective): the models partitioned by ``zero.Init``, rank 0's weights.

    Rank 0 holds its full build (on the CPU) until the copy is done; its random
    numbers are drawn as without ``zero.Init`` (the partitioned build runs with the
    generators' state restored afterwards).

    Raises:
        CreatorError: ``model_creator`` failed inside ``zero.Init``.
    """
    full = None
    if ctx.world_rank == 0:
        with building("empty"):  # polytrain.hf.from_pretrained: no weight read here
            full = create()
        with torch.random.fork_rng(devices=_cuda_devices(ctx)):
            partitioned = _under_zero_init(create, ctx, ds_config, deepspeed)
    else:
        partitioned = _under_zero_init(create, ctx, ds_config, deepspeed)
    for index, model in enumerate(partitioned):
        backed = {id(p) for p, _, _ in pretrained_fill.file_backed_params(model)}
        _copy_from_rank0(model, full[index] if full is not None else None, deepspeed, backed)
        _fill_partitions(model)
    return partitioned


def _under_zero_init(
    create: Callable[[], Sequence[torch.nn.Module]],
    ctx: WorkerContext,
    ds_config: dict[str, Any],
    deepspeed: Any,
) -> Sequence[torch.nn.Module]:
    import torch._dynamo  # noqa: F401 - see below
    import torch.distributed as dist

    # zero.Init replaces torch.Tensor.__new__ while it is open; torch._dynamo, imported
    # lazily (e.g. by transformers inside the creator), checks that function's signature
    # when first imported and fails on the replacement: import it before.

    # zero.Init reads the world from DeepSpeed's comm layer: wrap the group that is up.
    deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    # building: transformers' from_pretrained builds the structure only (without an
    # HfDeepSpeedConfig it would read every weight into the empty partitions and fail).
    # Each module is built in full and partitioned: its freed blocks must leave the heap.
    with (
        large_blocks_mapped(),
        deepspeed.zero.Init(config_dict_or_path=ds_config),
        building("zero3"),
    ):
        try:
            return create()
        except Exception as exc:
            where = "inside deepspeed.zero.Init (partitioned as it is built)"
            raise meta_init.meta_error(exc, ctx, where, INIT_ON_RANK0_OFF) from exc


def _copy_from_rank0(
    model: torch.nn.Module, full: torch.nn.Module | None, deepspeed: Any, skip: set[int]
) -> None:
    """(every rank, collective) ``full``'s parameters and buffers (rank 0) into ``model``.

    ``skip``: the ids of parameters read from pretrained files instead.
    """
    sources = dict(full.named_modules()) if full is not None else {}
    seen: set[int] = set(skip)
    for name, module in model.named_modules():
        own = [(k, p) for k, p in module._parameters.items() if p is not None and id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
            if full is not None:
                with torch.no_grad():
                    for attr, param in own:
                        param.data.copy_(getattr(sources[name], attr))
    buffers = dict(model.named_buffers())
    if full is not None:
        with torch.no_grad():
            for name, buffer in full.named_buffers():
                buffers[name].copy_(buffer)
    # Non-persistent buffers too: every rank gets rank 0's, as every parameter.
    meta_init.broadcast_from_rank0(list(buffers.values()))


@torch.no_grad()
def _fill_partitions(model: torch.nn.Module) -> None:
    """Worker: each rank reads its ZeRO-3 partition of every file-backed parameter.

    Rank ``r`` holds elements ``[r * p, (r + 1) * p)`` of the flattened parameter
    (``p = ds_tensor.ds_numel``; the last partition is padded with zeros).
    """
    import torch.distributed as dist

    for param, source, key in list(pretrained_fill.file_backed_params(model)):
        pretrained_fill.check_shape(source, key, tuple(param.ds_shape))
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
        size = int(param.ds_tensor.ds_numel)
        start = rank * size
        numel = max(0, min(size, int(param.ds_numel) - start))
        local = param.ds_tensor.data.reshape(-1)
        if numel:
            local[:numel].copy_(source.weights.read(key, start, numel))
        local[numel:].zero_()
    pretrained_fill.forget_sources(model)


def _cuda_devices(ctx: WorkerContext) -> list[int]:
    return [ctx.device.index or 0] if ctx.device.type == "cuda" else []
