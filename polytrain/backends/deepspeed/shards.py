"""Sharded checkpoints of the ``deepspeed`` backend: each rank saves and loads its ZeRO partitions (worker side).

ZeRO keeps fp32 master weights and optimizer state in flat partitions, one per
param group per rank. Every parameter's slice of a partition is a contiguous
range of the flattened parameter:

* stages 1 and 2: ``param._hp_mapping`` (``lp_fragment_address``: where the slice
  starts in the parameter; ``hp_fragment_address``: where it sits in the flat
  partition);
* stage 3: rank ``r`` holds elements ``[r * p, (r + 1) * p)`` of every parameter
  (``p = param.ds_tensor.ds_numel``, the last partition padded).

Those ranges are the :class:`~polytrain.checkpoint.pieces.Piece` ranges of a
sharded checkpoint, so nothing is gathered to save and a rank loads only what
it holds. Stage 0 (nothing partitioned) saves the consolidated state from rank 0.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.deepspeed.state import (
    EngineState,
    check_param_groups,
    flat_partitions,
    flat_state_keys,
    param_shape,
    torch_param_groups,
)
from polytrain.checkpoint.pieces import (
    LocalState,
    Piece,
    ShardReader,
    left_out,
    persistent_buffers,
    whole_piece,
)
from polytrain.errors import CheckpointError

logger = logging.getLogger(__name__)


def _stage3_range(param: torch.nn.Parameter) -> tuple[int, int, int]:
    """``(start, valid numel, partition numel)`` of this rank's stage-3 partition of ``param``."""
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    size = int(param.ds_tensor.ds_numel)
    start = rank * size
    return start, max(0, min(size, int(param.ds_numel) - start)), size


# --------------------------------------------------------------------- save
def local_state(state: EngineState, ctx: WorkerContext) -> LocalState:
    """Worker: this rank's ZeRO partitions of the weights and the optimizer state (no communication)."""
    module = state.engine.module
    partitioned = {id(p) for p in state.params}
    pieces: list[Piece] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        path = ("models", 0, name)
        local = _local_weights(state, param, id(param) in partitioned)
        if local is None:
            pieces.append(whole_piece(path, param, replicated=True))
        elif local[1].numel():
            pieces.append(Piece(path, tuple(param_shape(param)), local[1], local[0], False))
    for name, buffer in persistent_buffers(module):
        pieces.append(whole_piece(("models", 0, name), buffer, replicated=True))
    skeleton_state: dict[int, dict[str, Any]] = {}
    pieces += _optimizer_pieces(state, skeleton_state)
    skeleton = None
    if ctx.world_rank == 0:
        skeleton = {
            "models": [{}],
            "optimizers": [{"state": skeleton_state, "param_groups": torch_param_groups(state)}],
        }
    return LocalState(pieces=pieces, skeleton=skeleton)


def _local_weights(
    state: EngineState, param: torch.nn.Parameter, partitioned: bool
) -> tuple[int, torch.Tensor] | None:
    """``(start, this rank's fp32 master slice)`` of a partitioned parameter; None: held whole."""
    if state.stage >= 3 and hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param

        start, numel, _ = _stage3_range(param)
        local = safe_get_local_fp32_param(param) if partitioned else None
        if local is None:  # frozen: only the module's own partition exists
            local = param.ds_tensor
        return start, local.detach().reshape(-1)[:numel]
    if not partitioned:
        return None
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return 0, param.detach().reshape(-1)[:0]
    return int(mapping.lp_fragment_address.start), mapping.hp_fragment.detach().reshape(-1)


def _optimizer_pieces(state: EngineState, skeleton_state: dict[int, dict[str, Any]]) -> list[Piece]:
    ds_optimizer = state.engine.optimizer
    tensor_keys, scalars = flat_state_keys(ds_optimizer)
    if not tensor_keys:
        return []  # no step yet: no state
    pieces = []
    for index, param in enumerate(state.params):
        base = ("optimizers", 0, "state", index)
        for key, value in scalars.items():
            if torch.is_tensor(value):
                pieces.append(whole_piece((*base, key), value, replicated=True))
            else:
                skeleton_state.setdefault(index, {})[key] = copy.deepcopy(value)
        for key in tensor_keys:
            found = _local_optimizer_slice(state, param, key)
            if found is not None and found[1].numel():
                pieces.append(Piece((*base, key), tuple(param_shape(param)), found[1], found[0]))
    return pieces


def _local_optimizer_slice(
    state: EngineState, param: torch.nn.Parameter, key: str
) -> tuple[int, torch.Tensor] | None:
    if state.stage >= 3:
        from deepspeed.utils import safe_get_local_optimizer_state

        start, numel, _ = _stage3_range(param)
        value = safe_get_local_optimizer_state(param, key)
        return None if value is None else (start, value.detach().reshape(-1)[:numel])
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    flat = flat_partitions(state.engine.optimizer)[mapping.param_group_index]
    full = state.engine.optimizer.optimizer.state[flat][key]
    address = mapping.hp_fragment_address
    return int(mapping.lp_fragment_address.start), full.detach().narrow(
        0, address.start, address.numel
    )


# --------------------------------------------------------------------- load
@torch.no_grad()
def load(state: EngineState, reader: ShardReader) -> None:
    """Worker: load a sharded checkpoint from any backend, reading only what this rank holds.

    Stages 1-2 read the whole weights (every rank holds the full module) and only
    their partitions of the optimizer state; stage 3 reads only its partitions.
    """
    module = state.engine.module
    partitioned = {id(p) for p in state.params}
    kept = left_out(reader.skeleton, 0)  # frozen tensors the checkpoint left out
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in kept and reader.shape(("models", 0, name)) is None:
            continue
        _load_param(state, reader, ("models", 0, name), param, id(param) in partitioned)
    for name, buffer in persistent_buffers(module):
        _require(reader, ("models", 0, name), tuple(buffer.shape))
        buffer.copy_(reader.read(("models", 0, name)).reshape(buffer.shape))
    _load_optimizer(state, reader)


def _require(reader: ShardReader, path: tuple[Any, ...], shape: tuple[int, ...]) -> None:
    saved = reader.shape(path)
    if saved is None or tuple(saved) != tuple(shape):
        raise CheckpointError(
            f"The checkpoint's {path[-1]!r} has shape {saved}; this model's has {tuple(shape)} "
            f"(None: missing). Load a checkpoint of the same model."
        )


def _load_param(
    state: EngineState, reader: ShardReader, path: tuple[Any, ...], param: Any, partitioned: bool
) -> None:
    _require(reader, path, tuple(param_shape(param)))
    if state.stage >= 3 and hasattr(param, "ds_id"):
        from deepspeed.utils import safe_set_local_fp32_param

        start, numel, size = _stage3_range(param)
        padded = torch.zeros(size, dtype=torch.float32)
        padded[:numel] = reader.read(path, start, numel)
        param.ds_tensor.data.copy_(padded.to(param.ds_tensor.device, param.ds_tensor.dtype))
        if partitioned:
            safe_set_local_fp32_param(param, padded.to(param.ds_tensor.device))
        return
    full = reader.read(path).reshape(param.shape)
    param.data.copy_(full.to(param.device, param.dtype))
    mapping = getattr(param, "_hp_mapping", None) if partitioned else None
    if mapping is not None:
        start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        mapping.hp_fragment.data.copy_(full.reshape(-1)[start : start + numel])


def _load_optimizer(state: EngineState, reader: ShardReader) -> None:
    skeleton = (reader.skeleton.get("optimizers") or [None])[0]
    if skeleton is None:
        logger.warning(
            "The checkpoint has no optimizer state; the DeepSpeed optimizer starts fresh."
        )
        return
    check_param_groups(state, skeleton.get("param_groups") or [])
    for group, saved in zip(
        state.user_optimizer.param_groups, skeleton["param_groups"], strict=True
    ):
        group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
    keys = _saved_keys(state, reader)
    if keys is None:
        return
    tensor_keys, scalars = keys
    inner = state.engine.optimizer.optimizer
    for flat in flat_partitions(state.engine.optimizer):
        entry = inner.state[flat]
        for key in tensor_keys:
            entry.setdefault(key, torch.zeros_like(flat))
        for key, value in scalars.items():
            entry[key] = value.clone() if torch.is_tensor(value) else value
    link = getattr(state.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    for index, param in enumerate(state.params):
        for key in tensor_keys:
            _load_optimizer_slice(state, reader, ("optimizers", 0, "state", index, key), param, key)


def _saved_keys(state: EngineState, reader: ShardReader) -> tuple[list[str], dict[str, Any]] | None:
    """The checkpoint's per-element state keys and scalar values (from its first parameter)."""
    for index, param in enumerate(state.params):
        prefix = ("optimizers", 0, "state", index)
        paths = [p for p in reader.paths() if p[:4] == prefix and len(p) == 5]
        if not paths:
            continue
        shape = tuple(param_shape(param))
        tensor_keys = sorted(p[4] for p in paths if tuple(reader.shape(p)) == shape and shape)
        scalars = {
            p[4]: reader.read(p).reshape(reader.shape(p)) for p in paths if p[4] not in tensor_keys
        }
        scalars.update((reader.skeleton["optimizers"][0].get("state") or {}).get(index, {}))
        return tensor_keys, scalars
    logger.warning("The checkpoint has no optimizer state; the DeepSpeed optimizer starts fresh.")
    return None


def _load_optimizer_slice(
    state: EngineState, reader: ShardReader, path: tuple[Any, ...], param: Any, key: str
) -> None:
    if reader.shape(path) is None:
        return
    if state.stage >= 3:
        from deepspeed.utils import safe_set_local_optimizer_state

        start, numel, size = _stage3_range(param)
        padded = torch.zeros(size, dtype=torch.float32)
        padded[:numel] = reader.read(path, start, numel)
        safe_set_local_optimizer_state(param, padded.to(param.ds_tensor.device), key)
        return
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return
    flat = flat_partitions(state.engine.optimizer)[mapping.param_group_index]
    target = state.engine.optimizer.optimizer.state[flat][key]
    address = mapping.hp_fragment_address
    value = reader.read(path, mapping.lp_fragment_address.start, address.numel)
    target.narrow(0, address.start, address.numel).copy_(value.to(target.device, target.dtype))
