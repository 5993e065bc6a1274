"""Sharded checkpoints of the ``fsdp`` backend: each rank saves and loads only its own shards (worker side).

Both versions of torch's FSDP leave each rank a contiguous range of every
flattened original parameter, with the optimizer state beside it in the same
shape:

- FSDP1 with ``use_orig_params=True`` keeps every original parameter as a 1-D
  view of this rank's part of the flattened parameter (``_ShardParamInfo``:
  elements ``[intra_param_start_idx, intra_param_end_idx]`` of the flattened
  original), see :func:`param_ranges`;
- FSDP2 (``fully_shard``) makes every parameter a ``DTensor`` sharded on dim 0,
  so a rank holds whole rows: a contiguous range too, see
  :func:`polytrain.backends.fsdp.state_v2.dtensor_ranges`.

Those ranges are exactly the :class:`~polytrain.checkpoint.pieces.Piece`
ranges of a sharded checkpoint: nothing is gathered to save, and loading reads
only the ranges a rank holds, whatever backend and world size wrote them. The
functions here take the version's ``ranges_of(model)`` (None for a model that is
not sharded) and work for both.

The consolidated form keys optimizer state by parameter index (torch's own
``optimizer.state_dict()`` format); :func:`index_keyed` and :func:`name_keyed`
convert from and to the name-keyed form of ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.checkpoint.pieces import (
    LocalState,
    Piece,
    ShardReader,
    left_out,
    load_whole_model,
    local_optimizer_state,
    model_pieces,
    optimizer_pieces,
    optimizer_skeleton,
    persistent_buffers,
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


#: ``model -> {id(param): ParamRange}``, or None when the model is not sharded.
RangesOf = Callable[[torch.nn.Module], "dict[int, ParamRange] | None"]


def clean_name(name: str) -> str:
    """A parameter or buffer name without FSDP1's wrapper prefixes."""
    return name.replace(_FSDP_PREFIX, "")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor as it is), detached."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach()


def param_ranges(model: torch.nn.Module) -> dict[int, ParamRange]:
    """``id(param) -> ParamRange`` for every parameter FSDP1 manages in ``model``."""
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


def fsdp1_ranges(model: torch.nn.Module) -> dict[int, ParamRange] | None:
    """FSDP1's :data:`RangesOf`: :func:`param_ranges` of a ``FullyShardedDataParallel`` model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return param_ranges(model) if isinstance(model, FullyShardedDataParallel) else None


def _model_pieces(index: int, model: torch.nn.Module, ranges: dict[int, ParamRange]) -> list[Piece]:
    pieces = []
    for name, param in model.named_parameters(remove_duplicate=False):
        rng = ranges.get(id(param))
        path = ("models", index, clean_name(name))
        local = local_tensor(param)
        if rng is None or not rng.sharded:
            pieces.append(whole_piece(path, local.reshape(rng.shape if rng else local.shape), True))
        elif rng.numel:
            pieces.append(Piece(path, rng.shape, local.reshape(-1), rng.start, False))
    for name, buffer in persistent_buffers(model, clean_name):
        pieces.append(whole_piece(("models", index, name), local_tensor(buffer), True))
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
            value = local_tensor(value)
            if value.dim() == 0:
                if not rng.sharded or rng.start == 0:
                    pieces.append(whole_piece(path, value, not rng.sharded))
            elif value.numel() == rng.numel:
                if rng.numel:  # an empty shard (FSDP2, more ranks than rows) writes nothing
                    pieces.append(
                        Piece(path, rng.shape, value.reshape(-1), rng.start, not rng.sharded)
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
    owned: list[tuple[Any, Any, Any]],
    components: Components,
    ctx: WorkerContext,
    ranges_of: RangesOf = fsdp1_ranges,
) -> LocalState:
    """Worker: this rank's FSDP shards of every model and optimizer (no communication).

    Args:
        owned: ``(optimizer, its model or None, names)`` per optimizer.
        components: the prepared components.
        ctx: this worker's context.
        ranges_of: the FSDP version's ranges (:func:`fsdp1_ranges` by default).
    """

    def model_shards(index: int, model: Any) -> list[Piece] | None:
        ranges = ranges_of(model)
        return _model_pieces(index, model, ranges) if ranges is not None else None

    def optimizer_shards(index: int, optimizer: Any, model: Any) -> list[Piece] | None:
        ranges = ranges_of(model) if model is not None else None
        return _optimizer_pieces(index, optimizer, ranges) if ranges is not None else None

    return sharded_local_state(owned, components, ctx, model_shards, optimizer_shards)


def sharded_local_state(
    owned: list[tuple[Any, Any, Any]],
    components: Components,
    ctx: WorkerContext,
    model_shards: Callable[[int, Any], list[Piece] | None],
    optimizer_shards: Callable[[int, Any, Any], list[Piece] | None],
) -> LocalState:
    """Worker: a local state of the shards a layout gives, whole and replicated elsewhere.

    ``model_shards(index, model)`` / ``optimizer_shards(index, optimizer, model)``
    return this rank's pieces of a sharded model or optimizer, None for one that is
    not sharded (written whole, marked replicated). Rank 0 adds the skeleton.
    """
    pieces: list[Piece] = []
    for index, model in enumerate(components.models):
        found = model_shards(index, model)
        pieces += found if found is not None else model_pieces(index, model.state_dict(), True)
    for index, (optimizer, model, _) in enumerate(owned):
        found = optimizer_shards(index, optimizer, model)
        if found is None:
            found = optimizer_pieces(index, optimizer.state_dict(), replicated=True)
        pieces += found
    skeleton = None
    if ctx.world_rank == 0:
        skeleton = {
            "models": [{} for _ in components.models],
            "optimizers": [optimizer_skeleton(o.param_groups) for o, _, _ in owned],
        }
    return LocalState(pieces=pieces, skeleton=skeleton)


#: ``(torch-format optimizer state, the optimizer's params) -> the state to load``.
StateConverter = Callable[[dict[str, Any], list[Any]], dict[str, Any]]


def fsdp_load(
    owned: list[tuple[Any, Any, Any]],
    components: Components,
    reader: ShardReader,
    ranges_of: RangesOf = fsdp1_ranges,
    convert: StateConverter | None = None,
) -> None:
    """Worker: load this rank's ranges of a sharded checkpoint into FSDP models and their optimizers.

    Args:
        owned: ``(optimizer, its model or None, names)`` per optimizer.
        components: the prepared components.
        reader: the checkpoint.
        ranges_of: the FSDP version's ranges (:func:`fsdp1_ranges` by default).
        convert: turns the ranges read for a sharded model's optimizer into what its
            ``load_state_dict`` takes (FSDP2: DTensors laid out like the parameters).
    """
    for index, model in enumerate(components.models):
        ranges = ranges_of(model)
        if ranges is not None:
            _load_model(index, model, reader, ranges)
        else:
            load_whole_model(model, reader, index)
    for index, (optimizer, model, _) in enumerate(owned):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ranges = ranges_of(model) if model is not None else None
        if ranges is None:
            wanted: dict[int, tuple[int, int] | None] = {i: None for i in range(len(params))}
        else:
            wanted = {}
            for i, param in enumerate(params):
                rng = ranges.get(id(param))
                # FSDP1 keeps no state for a parameter outside this rank's shard; FSDP2 keeps
                # (empty) state on every rank, and every rank must agree on which exist.
                if rng is not None and (rng.numel or not rng.sharded or _is_dtensor(param)):
                    wanted[i] = (rng.start, rng.numel) if rng.sharded else None
        state = local_optimizer_state(reader, index, wanted)
        if state is not None:
            if ranges is not None and convert is not None:
                state = convert(state, params)
            optimizer.load_state_dict(state)


def _is_dtensor(tensor: Any) -> bool:
    return callable(getattr(tensor, "to_local", None))


@torch.no_grad()
def _load_model(
    index: int, model: torch.nn.Module, reader: ShardReader, ranges: dict[int, ParamRange]
) -> None:
    kept = left_out(reader.skeleton, index)  # frozen tensors the checkpoint left out
    for name, param in model.named_parameters(remove_duplicate=False):
        path = ("models", index, clean_name(name))
        if path[2] in kept and reader.shape(path) is None:
            continue
        rng = ranges.get(id(param))
        _check_shape(reader, path, rng.shape if rng else tuple(param.shape))
        # A DTensor's local shard shares its storage: writing it writes the parameter.
        local = param.to_local() if _is_dtensor(param) else param
        if rng is None or not rng.sharded:
            local.copy_(reader.read(path).reshape(local.shape))
        elif rng.numel:
            local.copy_(reader.read(path, rng.start, rng.numel).reshape(local.shape))
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


# ------------------------------------------------- index- and name-keyed states
def index_keyed(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state (torch.distributed.checkpoint) in torch's index-keyed format."""
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    by_index = {index[name]: value for name, value in state["state"].items()}
    return {"state": dict(sorted(by_index.items())), "param_groups": groups}


def name_keyed(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A torch index-keyed optimizer state keyed by parameter names, as FSDP loads it.

    Raises:
        CheckpointError: the state does not have one entry per parameter of the optimizer.
    """
    indices = [i for group in state["param_groups"] for i in group["params"]]
    if len(indices) != len(names):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {len(indices)} parameters; this "
            f"optimizer has {len(names)}. Load a checkpoint of the same model and optimizer."
        )
    name_of = dict(zip(indices, names, strict=True))
    return {
        "state": {name_of[i]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [name_of[i] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }
