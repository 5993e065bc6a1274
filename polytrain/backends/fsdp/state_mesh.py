"""Sharded checkpoints of a mesh-parallel model (HSDP, TP, TP + FSDP): any placement as row ranges.

A checkpoint directory stores every tensor as contiguous ranges of its flattened
form (:mod:`polytrain.checkpoint.pieces`): rows ``[r0, r1)`` of a tensor. Under a
mesh a parameter is a ``DTensor`` whose local block is not always such a range:

* a row-parallel weight is split by columns (``Shard(1)``) over TP, GPT-2's fused
  ``c_attn`` in interleaved blocks (``_StridedShard``);
* a parameter that is ``Replicate`` on some mesh dimension (the HSDP replicas, the
  norms under TP) is held, the same, by several ranks.

Saving: each parameter (and its optimizer state, laid out like it) is
redistributed over its own mesh to its *row layout*: ``Shard(0)`` on every mesh
dimension where it is sharded, ``Replicate`` where it is replicated. Nested
``Shard(0)`` leaves every rank one contiguous block of rows, the range it writes;
of the ranks holding the same block only the one at index 0 of every replicated
dimension writes it (a dimension of the world mesh that the tensor's mesh leaves out
counts as replicated: GPT-2's embeddings under TP). Blocks that already are row ranges (FSDP's ``Shard(0)``,
and FSDP over a column-parallel TP weight) are written as they are, without
communication. Loading reads the same ranges and redistributes back. A
checkpoint written under any mesh (or backend, or world size) loads under any
other: the files hold whole tensors' ranges, never a layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.fsdp.state_v1 import (
    _check_shape,
    clean_name,
    local_tensor,
    sharded_local_state,
)
from polytrain.checkpoint.pieces import (
    LocalState,
    Piece,
    ShardReader,
    local_optimizer_state,
    persistent_buffers,
    whole_model_state,
    whole_piece,
)


@dataclass
class RowLayout:
    """Where one rank's block of a DTensor sits when laid out by rows.

    Attributes:
        placements: the row layout's placements (the DTensor's own when it already is one).
        local_shape: the shape of this rank's block in that layout.
        start: the block's offset in the flattened full tensor.
        writes: whether this rank writes the block (index 0 of every replicated dimension).
        replicated: every rank holds the whole tensor.
        direct: the DTensor's own local block already is the block (no redistribution).
    """

    placements: tuple[Any, ...]
    local_shape: tuple[int, ...]
    start: int
    writes: bool
    replicated: bool
    direct: bool

    @property
    def numel(self) -> int:
        """The elements of the block."""
        return math.prod(self.local_shape)


def _rows_already(placements: tuple[Any, ...], mesh: Any) -> bool:
    """Whether these placements leave every rank a contiguous block of rows.

    Plain ``Shard(0)`` nests row blocks; FSDP's ``_StridedShard(0, sf)`` over a
    TP ``Shard(0)`` (a column-parallel weight) is the same nesting with TP first,
    when ``sf`` is the product of the later ``Shard(0)`` dimensions' sizes.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if isinstance(placement, _StridedShard):
            later = placements[i + 1 :]
            plain = all(p.is_replicate() or type(p) is Shard and p.dim == 0 for p in later)
            sizes = math.prod(mesh.size(j) for j, p in enumerate(later, i + 1) if p.is_shard())
            if placement.dim != 0 or not plain or placement.split_factor != sizes:
                return False
        elif not (type(placement) is Shard and placement.dim == 0):
            return False
    return True


def row_layout(tensor: Any, world: Mapping[str, int] | None = None) -> RowLayout:
    """The :class:`RowLayout` of a DTensor on this rank.

    Args:
        tensor: the DTensor.
        world: this rank's index on every dimension of the world mesh, by name. A tensor
            whose mesh leaves some out (GPT-2's embeddings under TP live on the
            data-parallel mesh only) is the same on every index of those: rank 0 of them
            writes it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, own = tensor.device_mesh, tuple(tensor.placements)
    direct = _rows_already(own, mesh)
    placements = (
        own if direct else tuple(Replicate() if p.is_replicate() else Shard(0) for p in own)
    )
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    replicated_dims = [i for i, p in enumerate(placements) if p.is_replicate()]
    names = mesh.mesh_dim_names or ()
    outside = [index for name, index in (world or {}).items() if name not in names]
    start = int(offset[0]) * math.prod(tensor.shape[1:]) if tensor.dim() else 0
    return RowLayout(
        placements=placements,
        local_shape=tuple(int(d) for d in local_shape),
        start=start,
        writes=all(coordinate[i] == 0 for i in replicated_dims) and not any(outside),
        replicated=len(replicated_dims) == len(placements),
        direct=direct,
    )


def to_rows(tensor: Any, layout: RowLayout) -> torch.Tensor:
    """Worker (collective over the tensor's mesh unless direct): this rank's row block, flattened."""
    if not layout.direct:
        tensor = tensor.redistribute(tensor.device_mesh, layout.placements)
    return tensor.to_local().detach().reshape(-1)


def from_rows(values: torch.Tensor, like: Any, layout: RowLayout) -> Any:
    """Worker (collective unless direct): a DTensor laid out like ``like`` from this rank's row block."""
    from torch.distributed.tensor import DTensor

    local = values.reshape(layout.local_shape).to(device=like.device, dtype=like.dtype)
    rows = DTensor.from_local(
        local, like.device_mesh, layout.placements, run_check=False,
        shape=like.shape, stride=like.stride(),
    )  # fmt: skip
    return rows if layout.direct else rows.redistribute(like.device_mesh, like.placements)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _piece(path: tuple[Any, ...], tensor: Any, world: Mapping[str, int] | None) -> Piece | None:
    """This rank's piece of ``tensor`` (None: another rank writes this block)."""
    if not _is_dtensor(tensor):
        return whole_piece(path, local_tensor(tensor), True)
    layout = row_layout(tensor, world)
    rows = to_rows(tensor, layout)  # every rank takes part in the redistribution
    if layout.replicated:
        return Piece(path, tuple(tensor.shape), rows, 0, True)
    if not layout.writes or not layout.numel:
        return None
    return Piece(path, tuple(tensor.shape), rows, layout.start, False)


def _model_pieces(
    index: int, model: torch.nn.Module, world: Mapping[str, int] | None
) -> list[Piece]:
    pieces = []
    for name, param in model.named_parameters(remove_duplicate=False):
        piece = _piece(("models", index, clean_name(name)), param, world)
        if piece is not None:
            pieces.append(piece)
    for name, buffer in persistent_buffers(model, clean_name):
        pieces.append(whole_piece(("models", index, name), local_tensor(buffer), True))
    return pieces


def _optimizer_pieces(
    index: int, optimizer: torch.optim.Optimizer, world: Mapping[str, int] | None
) -> list[Piece]:
    """Per-element state as row blocks; a scalar (``step``) by the writer of row 0."""
    pieces = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param_index, param in enumerate(params):
        state = optimizer.state.get(param) or {}
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            path = ("optimizers", index, "state", param_index, key)
            if value.dim() == 0 and _is_dtensor(param):
                layout = row_layout(param, world)
                if layout.replicated or (layout.writes and layout.start == 0):
                    pieces.append(whole_piece(path, local_tensor(value), layout.replicated))
                continue
            piece = _piece(path, value, world)
            if piece is not None:
                pieces.append(piece)
    return pieces


@torch.no_grad()
def mesh_local_state(
    owned: list[tuple[Any, Any, Any]],
    components: Components,
    ctx: WorkerContext,
    world: Mapping[str, int] | None = None,
) -> LocalState:
    """Worker (every rank, collective): this rank's row blocks of every model and optimizer.

    Args:
        owned: ``(optimizer, its model or None, names)`` per optimizer.
        components: the prepared components.
        ctx: this worker's context.
        world: this rank's index on every dimension of the world mesh, by name.
    """

    def sharded(model: Any) -> bool:
        return model is not None and any(_is_dtensor(p) for p in model.parameters())

    def model_shards(index: int, model: Any) -> list[Piece] | None:
        return _model_pieces(index, model, world) if sharded(model) else None

    def optimizer_shards(index: int, optimizer: Any, model: Any) -> list[Piece] | None:
        return _optimizer_pieces(index, optimizer, world) if sharded(model) else None

    return sharded_local_state(owned, components, ctx, model_shards, optimizer_shards)


@torch.no_grad()
def _load_model(index: int, model: torch.nn.Module, reader: ShardReader) -> None:
    for name, param in model.named_parameters(remove_duplicate=False):
        path = ("models", index, clean_name(name))
        _check_shape(reader, path, tuple(param.shape))
        if not _is_dtensor(param):
            param.copy_(reader.read(path).reshape(param.shape))
            continue
        layout = row_layout(param)
        values = reader.read(path, layout.start, layout.numel)
        # The local shard shares the parameter's storage: writing it writes the parameter.
        param.to_local().copy_(from_rows(values, param, layout).to_local())
    for name, buffer in persistent_buffers(model, clean_name):
        path = ("models", index, name)
        _check_shape(reader, path, tuple(buffer.shape))
        buffer.copy_(reader.read(path).reshape(buffer.shape))


def _load_optimizer(index: int, optimizer: torch.optim.Optimizer, reader: ShardReader) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layouts = {i: row_layout(p) for i, p in enumerate(params) if _is_dtensor(p)}
    wanted = {
        i: (layouts[i].start, layouts[i].numel) if i in layouts else None
        for i in range(len(params))
    }
    state = local_optimizer_state(reader, index, wanted)
    if state is None:
        return
    for i, entry in state["state"].items():
        if i not in layouts:
            continue
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = from_rows(value, params[i], layouts[i])
    optimizer.load_state_dict(state)


@torch.no_grad()
def mesh_load(
    owned: list[tuple[Any, Any, Any]], components: Components, reader: ShardReader
) -> None:
    """Worker (every rank, collective): load this rank's blocks of a checkpoint from any layout."""
    for index, model in enumerate(components.models):
        if any(_is_dtensor(p) for p in model.parameters()):
            _load_model(index, model, reader)
        else:
            model.load_state_dict(whole_model_state(reader, index))
    for index, (optimizer, _, _) in enumerate(owned):
        _load_optimizer(index, optimizer, reader)
