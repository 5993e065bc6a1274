"""Sharded checkpoints of the ``fsdp`` backend: each rank saves and loads only its own shards (worker side).

With ``use_orig_params=True`` FSDP1 keeps every original parameter as a 1-D
view of this rank's part of the flattened parameter (``_ShardParamInfo``:
elements ``[intra_param_start_idx, intra_param_end_idx]`` of the flattened
original) and the optimizer state beside it in the same shape. Those ranges are
exactly the :class:`~polytrain.backends.shard_state.Piece` ranges of a sharded
checkpoint: nothing is gathered to save, and loading reads only the ranges a
rank holds, whatever backend and world size wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.shard_state import (
    LocalState,
    Piece,
    ShardReader,
    local_optimizer_state,
    model_pieces,
    optimizer_pieces,
    optimizer_skeleton,
    persistent_buffers,
    whole_model_state,
    whole_piece,
)
from polytrain.errors import CheckpointError

_FSDP_PREFIX = "_fsdp_wrapped_module."


@dataclass
class ParamRange:
    """Where a parameter's local data sits in its flattened full tensor."""

    shape: tuple[int, ...]
    start: int
    numel: int
    sharded: bool


def clean_name(name: str) -> str:
    """A parameter or buffer name without FSDP's wrapper prefixes."""
    return name.replace(_FSDP_PREFIX, "")


def param_ranges(model: torch.nn.Module) -> dict[int, ParamRange]:
    """``id(param) -> ParamRange`` for every parameter FSDP manages in ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    ranges: dict[int, ParamRange] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        sharded = bool(handle.uses_sharded_strategy)
        for param, info, shape in zip(
            flat._params, flat._shard_param_infos, flat._shapes, strict=True
        ):
            full = tuple(int(d) for d in shape)
            if not sharded:
                ranges[id(param)] = ParamRange(full, 0, int(param.numel()), False)
            elif info.in_shard:
                ranges[id(param)] = ParamRange(
                    full, int(info.intra_param_start_idx), int(info.numel_in_shard), True
                )
            else:
                ranges[id(param)] = ParamRange(full, 0, 0, True)
        for param, shared in zip(flat._shared_params or [], flat._shared_param_infos, strict=True):
            primary = getattr(shared.prim_module, shared.prim_param_name)
            if id(primary) in ranges:
                ranges[id(param)] = ranges[id(primary)]
    return ranges


def _model_pieces(index: int, model: torch.nn.Module) -> list[Piece]:
    ranges = param_ranges(model)
    pieces = []
    for name, param in model.named_parameters(remove_duplicate=False):
        rng = ranges.get(id(param))
        path = ("models", index, clean_name(name))
        if rng is None or not rng.sharded:
            pieces.append(
                whole_piece(path, param.detach().reshape(rng.shape if rng else param.shape), True)
            )
        elif rng.numel:
            pieces.append(Piece(path, rng.shape, param.detach().reshape(-1), rng.start, False))
    for name, buffer in persistent_buffers(model, clean_name):
        pieces.append(whole_piece(("models", index, name), buffer, True))
    return pieces


def _optimizer_pieces(
    index: int, optimizer: torch.optim.Optimizer, ranges: dict[int, ParamRange]
) -> list[Piece]:
    """The optimizer's per-parameter state over this rank's ranges.

    State shaped like the local shard is a range of the full state tensor; a 0-dim
    entry (``step``) is written by the rank holding the parameter's first element.
    """
    pieces = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param_index, param in enumerate(params):
        state = optimizer.state.get(param)
        rng = ranges.get(id(param))
        if not state or rng is None:
            continue
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            path = ("optimizers", index, "state", param_index, key)
            if value.dim() == 0:
                if not rng.sharded or rng.start == 0:
                    pieces.append(whole_piece(path, value, not rng.sharded))
            elif value.numel() == rng.numel:
                pieces.append(
                    Piece(path, rng.shape, value.detach().reshape(-1), rng.start, not rng.sharded)
                )
            else:
                raise CheckpointError(
                    f"Optimizer {type(optimizer).__name__} keeps state {key!r} of shape "
                    f"{tuple(value.shape)} for a parameter shard of {rng.numel} elements; only "
                    f"per-element and scalar state can be saved sharded. Use trainer.save(path) "
                    f"(consolidated) for this optimizer."
                )
    return pieces


def fsdp_local_state(
    owned: list[tuple[Any, Any, Any]], components: Components, ctx: WorkerContext
) -> LocalState:
    """Worker: this rank's FSDP shards of every model and optimizer (no communication).

    Args:
        owned: ``(optimizer, its model or None, names)`` per optimizer.
        components: the prepared components.
        ctx: this worker's context.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    pieces: list[Piece] = []
    for index, model in enumerate(components.models):
        if isinstance(model, FullyShardedDataParallel):
            pieces += _model_pieces(index, model)
        else:
            pieces += model_pieces(index, model.state_dict(), replicated=True)
    for index, (optimizer, model, _) in enumerate(owned):
        if isinstance(model, FullyShardedDataParallel):
            pieces += _optimizer_pieces(index, optimizer, param_ranges(model))
        else:
            pieces += optimizer_pieces(index, optimizer.state_dict(), replicated=True)
    skeleton = None
    if ctx.world_rank == 0:
        skeleton = {
            "models": [{} for _ in components.models],
            "optimizers": [optimizer_skeleton(o.param_groups) for o, _, _ in owned],
        }
    return LocalState(pieces=pieces, skeleton=skeleton)


def fsdp_load(
    owned: list[tuple[Any, Any, Any]], components: Components, reader: ShardReader
) -> None:
    """Worker: load this rank's ranges of a sharded checkpoint into FSDP models and their optimizers."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for index, model in enumerate(components.models):
        if isinstance(model, FullyShardedDataParallel):
            _load_model(index, model, reader)
        else:
            model.load_state_dict(whole_model_state(reader, index))
    for index, (optimizer, model, _) in enumerate(owned):
        if isinstance(model, FullyShardedDataParallel):
            ranges = param_ranges(model)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            wanted = {}
            for i, param in enumerate(params):
                rng = ranges.get(id(param))
                if rng is not None and (rng.numel or not rng.sharded):
                    wanted[i] = (rng.start, rng.numel) if rng.sharded else None
        else:
            wanted = {i: None for i in range(sum(len(g["params"]) for g in optimizer.param_groups))}
        state = local_optimizer_state(reader, index, wanted)
        if state is not None:
            optimizer.load_state_dict(state)


@torch.no_grad()
def _load_model(index: int, model: torch.nn.Module, reader: ShardReader) -> None:
    ranges = param_ranges(model)
    for name, param in model.named_parameters(remove_duplicate=False):
        path = ("models", index, clean_name(name))
        rng = ranges.get(id(param))
        _check_shape(reader, path, rng.shape if rng else tuple(param.shape))
        if rng is None or not rng.sharded:
            param.copy_(reader.read(path).reshape(param.shape))
        elif rng.numel:
            param.copy_(reader.read(path, rng.start, rng.numel).reshape(param.shape))
    for name, buffer in persistent_buffers(model, clean_name):
        path = ("models", index, name)
        _check_shape(reader, path, tuple(buffer.shape))
        buffer.copy_(reader.read(path).reshape(buffer.shape))


def _check_shape(reader: ShardReader, path: tuple[Any, ...], shape: tuple[int, ...]) -> None:
    saved = reader.shape(path)
    if saved is None:
        raise CheckpointError(
            f"The checkpoint has no {path[2]!r} for model {path[1]}; it was saved from another "
            f"model. Load a checkpoint of the same model."
        )
    if tuple(saved) != tuple(shape):
        raise CheckpointError(
            f"The checkpoint's {path[2]!r} of model {path[1]} has shape {tuple(saved)}; this "
            f"model's has {tuple(shape)}. Load a checkpoint of the same model."
        )
