"""Tensor-parallel styles for HF's ``Conv1D`` (GPT-2), which torch's own styles do not handle.

``transformers.pytorch_utils.Conv1D`` computes ``y = x @ W + b`` with ``W`` of shape
``(in, out)``: the transpose of ``nn.Linear``'s. torch's ``ColwiseParallel`` /
``RowwiseParallel`` shard ``Linear`` weights on the dims of ``(out, in)``, so on a
``Conv1D`` they would split the wrong dimension. The two styles here shard it
right (worker side):

* :class:`Conv1DColwise`: the outputs split over the TP ranks (``W`` on dim 1, ``b``
  on dim 0). ``fused=3`` is GPT-2's ``c_attn``, whose outputs are q, k and v side by
  side: each of the three is split, so rank r holds ``[q_r, k_r, v_r]`` of the weight
  (``_StridedShard(1, split_factor=3)``, torch's layout for a dimension sharded in
  interleaved blocks), i.e. whole attention heads of each; the fused bias (3 x d
  values) stays whole on every rank, which takes its parts of it.
* :class:`Conv1DRowwise`: the inputs split (``W`` on dim 0, ``b`` replicated); the
  partial products are summed over the TP ranks.

The matmuls run on the local shards. Autograd stays right through DTensor's own
conversions: the replicated input of a column-parallel layer is taken with a
``Partial`` gradient (summed over the ranks in backward, as in Megatron-LM's ``f``),
the partial output of a row-parallel layer is reduced in forward and its gradient
passes through unchanged (Megatron-LM's ``g``). Parameter names, shapes (global)
and state dicts stay those of the unsharded module.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def _distribute(module: torch.nn.Module, name: str, mesh: Any, placement: Any, src: Any) -> None:
    param = getattr(module, name)
    dtensor = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src)
    module.register_parameter(name, torch.nn.Parameter(dtensor, param.requires_grad))


def _replicated(x: torch.Tensor, mesh: Any) -> DTensor:
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()])
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class Conv1DColwise(ParallelStyle):
    """A ``Conv1D`` whose outputs are split over the TP mesh; its output is the local part.

    Args:
        fused: how many equal, independently split parts the outputs hold (3 for
            GPT-2's ``c_attn``: q, k, v).
    """

    def __init__(self, fused: int = 1) -> None:
        super().__init__()
        self.fused = fused

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        placement = _StridedShard(1, split_factor=self.fused) if self.fused > 1 else Shard(1)
        # A fused bias stays whole on every TP rank, each taking its parts in forward:
        # FSDP shards dim 0 too, and its placement of a 1-D tensor split twice in
        # interleaved blocks is not one DTensor gathers or redistributes right.
        bias = Replicate() if self.fused > 1 else Shard(0)
        _distribute(module, "weight", device_mesh, placement, self.src_data_rank)
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", device_mesh, bias, self.src_data_rank)
        module.forward = functools.partial(_colwise_forward, module, device_mesh, self.fused)
        return module


class Conv1DRowwise(ParallelStyle):
    """A ``Conv1D`` whose inputs are split over the TP mesh; its output is whole on every rank."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        module.forward = functools.partial(_rowwise_forward, module, device_mesh)
        return module


def _colwise_forward(
    module: torch.nn.Module, mesh: Any, fused: int, x: torch.Tensor
) -> torch.Tensor:
    # Every rank's part of the output depends on all of x: its gradient is a sum over ranks.
    local = _replicated(x, mesh).to_local(grad_placements=[Partial()])
    weight = module.weight.to_local()
    flat = local.reshape(-1, local.shape[-1])
    if module.bias is None:
        out = flat @ weight
    else:
        out = torch.addmm(_local_bias(module.bias, mesh, fused), flat, weight)
    return out.view(*local.shape[:-1], weight.shape[-1])


def _local_bias(bias: DTensor, mesh: Any, fused: int) -> torch.Tensor:
    """This rank's part of a column-parallel bias (of each fused part: ``[q_r, k_r, v_r]``)."""
    if fused == 1:
        return bias.to_local()
    # Whole on every rank, each using its parts: the gradient is the sum over the ranks.
    whole = bias.to_local(grad_placements=[Partial()])
    return whole.view(fused, mesh.size(), -1)[:, mesh.get_local_rank()].reshape(-1)


def _rowwise_forward(module: torch.nn.Module, mesh: Any, x: torch.Tensor) -> torch.Tensor:
    local = x.to_local() if isinstance(x, DTensor) else x
    weight = module.weight.to_local()
    partial = (local.reshape(-1, local.shape[-1]) @ weight).view(*local.shape[:-1], -1)
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    out = out.redistribute(mesh, [Replicate()]).to_local()
    return out if module.bias is None else out + module.bias.to_local()
