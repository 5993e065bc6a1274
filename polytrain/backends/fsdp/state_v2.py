"""FSDP2's shard layout in sharded checkpoints (worker side).

``fully_shard`` makes every parameter a ``DTensor`` with placement ``Shard(0)``:
a rank holds whole rows ``[r0, r0 + k)`` of the parameter (torch.chunk's split,
so the last ranks may hold fewer rows, or none), and Adam's ``exp_avg`` /
``exp_avg_sq`` are DTensors laid out the same way. In the flattened tensor those
rows are one contiguous range, ``[r0 * row, (r0 + k) * row)``: exactly a
:class:`~polytrain.checkpoint.pieces.Piece`. :func:`dtensor_ranges` gives
those ranges to :mod:`polytrain.backends.fsdp.state_v1`, which writes and reads
them for both FSDP versions; :func:`as_param_layout` turns the ranges read back
into DTensors for the optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from polytrain.backends.fsdp.state_v1 import ParamRange
from polytrain.errors import CheckpointError


def dtensor_range(tensor: torch.Tensor) -> ParamRange:
    """Where this rank's local shard of ``tensor`` sits in the flattened full tensor.

    A plain tensor is held whole by every rank (not sharded).

    Raises:
        CheckpointError: a DTensor not sharded by rows (only dim-0 sharding, FSDP2's
            default, gives contiguous ranges).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(int(d) for d in tensor.shape)
    if not isinstance(tensor, DTensor):
        return ParamRange(shape, 0, int(tensor.numel()), False)
    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tuple(local_shape[1:]) != shape[1:]:
        raise CheckpointError(
            f"A parameter of shape {shape} is sharded as {tensor.placements} (local shape "
            f"{tuple(local_shape)}); a sharded checkpoint needs parameters sharded by rows "
            f"(Shard(0), fully_shard's default). Use trainer.save(path) (consolidated) instead."
        )
    start = int(offset[0]) * math.prod(shape[1:]) if shape else 0
    sharded = any(placement.is_shard() for placement in tensor.placements)
    return ParamRange(shape, start, math.prod(local_shape), sharded)


def dtensor_ranges(model: torch.nn.Module) -> dict[int, ParamRange]:
    """``id(param) -> ParamRange`` for every parameter of a ``fully_shard``-ed model."""
    return {id(param): dtensor_range(param) for param in model.parameters()}


def as_param_layout(state: dict[str, Any], params: list[Any]) -> dict[str, Any]:
    """A torch-format optimizer state read as this rank's ranges, laid out like the parameters.

    Per-element state (``exp_avg``: read as a 1-D range) of a DTensor parameter
    becomes a DTensor with the parameter's mesh, placements and global shape, on its
    device, as the optimizer's own state is; scalars (``step``) stay as they are.

    Args:
        state: ``{"state": {param index: {key: tensor}}, "param_groups": [...]}``.
        params: the optimizer's parameters in index order.
    """
    from torch.distributed.tensor import DTensor

    for index, entry in state["state"].items():
        param = params[index]
        if not isinstance(param, DTensor):
            continue
        local = param.to_local()
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = DTensor.from_local(
                    value.reshape(local.shape).to(local.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
    return state
