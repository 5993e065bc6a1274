"""The ``fsdp`` backend on a device mesh: HSDP, tensor parallelism and both with FSDP (worker side).

``parallelism={"dp_replicate": R, "dp_shard": S, "tp": T}`` on the fsdp backend
(version 2) runs :class:`MeshFSDPStrategy`. On every worker it:

1. builds a ``DeviceMesh`` of shape ``(R, S, T)`` named ``dp_replicate``, ``dp_shard``,
   ``tp`` from the ranks' node placement (:func:`polytrain.backends.core.parallelism.mesh_ranks`:
   TP inside a node, replicas outermost, across nodes);
2. applies, in torchtitan's order, the tensor-parallel plan over the ``tp`` mesh
   (:mod:`polytrain.backends.fsdp.tp_plans`), activation checkpointing, ``compile``
   of each unit, then ``fully_shard`` over ``(dp_replicate, dp_shard)`` (HSDP when R >
   1: sharded within a replica group, gradients all-reduced across them);
3. gives the data samplers the data-parallel rank (TP peers get the same batches);
4. clips over the whole mesh: the gradients are DTensors on different meshes (TP
   ones on ``(dp, tp)``, the rest on ``dp`` only), which torch's ``clip_grad_norm_``
   cannot stack; the norm of each mesh's group is reduced over its mesh and the
   squares are summed (torchtitan's way), then every group is scaled.

Everything else (rank-0 initialisation, optimizers over the shards, full state
dicts, ``no_sync``, precision) is the plain FSDP2 strategy's; sharded checkpoint
directories go through :mod:`polytrain.backends.fsdp.state_mesh`, which turns any
placement into row ranges.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.backends.core import meta_init, pretrained_fill
from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.blocks import apply_activation_checkpointing
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.parallelism import (
    MESH_DIMS,
    Parallelism,
    coordinates,
    data_parallel_rank,
    mesh_ranks,
)
from polytrain.backends.core.precision import Precision
from polytrain.backends.core.strategy import clipped_params, stepped
from polytrain.backends.fsdp import state_mesh
from polytrain.backends.fsdp.common import ShardedStates
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.backends.fsdp.strategy_v2 import FSDP2Strategy, _reshard
from polytrain.backends.fsdp.tp_plans import apply_tp_plan
from polytrain.checkpoint.pieces import LocalState, ShardReader


class MeshFSDPStrategy(FSDP2Strategy):
    """FSDP2 over a ``(dp_replicate, dp_shard, tp)`` mesh, with a TP plan when ``tp > 1``.

    Args:
        config: the fsdp backend's options (version 2).
        parallelism: the mesh sizes, resolved for the group's workers.
        tp_plan: the user's plan (``{pattern: style}``), or None for a built-in one.
    """

    #: The worker leaves activation checkpointing and ``compile`` to :meth:`shard`,
    #: which applies them between the TP plan and ``fully_shard``.
    applies_activation_checkpointing = True
    compiles_in_prepare = True

    def __init__(
        self,
        config: FSDPConfig | None = None,
        parallelism: Parallelism | None = None,
        tp_plan: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config)
        self.states = MeshStates(self)
        self.parallelism = parallelism or Parallelism()
        self.tp_plan = tp_plan
        self._world: Any = None
        self._coords: tuple[int, int, int] = (0, 0, 0)
        self.plan_name: str | None = None

    # ------------------------------------------------------------------ mesh
    def world_mesh(self, ctx: WorkerContext) -> Any:
        """Worker (every rank, collective the first time): the 3-D ``DeviceMesh``."""
        if self._world is None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            sizes = self.parallelism.resolve(ctx.world_size)
            places: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(places, (ctx.node_rank, ctx.local_rank))
            layout = mesh_ranks(sizes, [tuple(p) for p in places])
            self.parallelism = sizes
            self._coords = coordinates(layout, ctx.world_rank)
            self._world = DeviceMesh(
                ctx.device.type, torch.tensor(layout), mesh_dim_names=MESH_DIMS
            )
        return self._world

    def _device_mesh(self, ctx: WorkerContext) -> Any:
        """The mesh ``fully_shard`` runs on: ``(dp_replicate, dp_shard)`` (HSDP) or ``dp_shard``."""
        mesh = self.world_mesh(ctx)
        if self.parallelism.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """This rank's ``(dp_replicate, dp_shard, tp)`` index (after the mesh is built)."""
        return self._coords

    # ------------------------------------------------------------ preparation
    def shard(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        """TP plan, activation checkpointing, ``compile`` of the units, then ``fully_shard``."""
        mesh = self.world_mesh(ctx)
        if self.parallelism.tp > 1:
            self.plan_name = apply_tp_plan(model, mesh["tp"], self.tp_plan)
        apply_activation_checkpointing(model, ctx.step.activation_checkpointing)
        if ctx.step.compile:
            for unit in self.units(model) or [model]:
                unit.compile()
        return super().shard(model, ctx)

    @sharded_only
    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: ``(dp_replicate * dp_shard, data-parallel rank)``: TP peers read the same data."""
        self.world_mesh(ctx)
        return self.parallelism.data_parallel_size, data_parallel_rank(
            self.parallelism, self._coords
        )

    def counts_samples(self, ctx: WorkerContext) -> bool:
        """Worker: whether this rank's samples count in the metrics (TP rank 0 of its group)."""
        return self._coords[2] == 0

    # ------------------------------------------------------------------- step
    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: clip the norm over every shard and TP rank (per mesh, combined).

        With ``optimizer_index``: that optimizer's parameters only (a custom step's
        ``self.step(i)``).
        """
        (components.precision or Precision()).unscale_(stepped(components, optimizer_index))
        return clip_grad_norm_mesh(clipped_params(components, optimizer_index), max_norm)

    # ------------------------------------------------------------------ state
    @sharded_only
    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker (collective): this rank's row ranges of every parameter and optimizer state."""
        _reshard(components)
        world = dict(zip(MESH_DIMS, self._coords, strict=True))
        return state_mesh.mesh_local_state(self.states.owned(components), components, ctx, world)

    @sharded_only
    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker (collective): read this rank's row ranges of a checkpoint from any layout."""
        _reshard(components)
        state_mesh.mesh_load(self.states.owned(components), components, reader)


class MeshStates(ShardedStates):
    """The FSDP2 states, with rank 0's weights placed into DTensors of any placement.

    ``set_model_state_dict(broadcast_from_rank0=True)`` slices each tensor as if every
    shard were a block of whole rows or columns; GPT-2's ``c_attn`` under TP holds
    interleaved blocks (``_StridedShard``). Here each full tensor is broadcast from rank
    0 and every rank keeps what ``distribute_tensor`` gives it for the parameter's own
    placements: right for every placement, one parameter in flight at a time.
    """

    @torch.no_grad()
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """(every rank) A full torch-format state, placed as each parameter is (no communication).

        ``set_model_state_dict`` / ``set_optimizer_state_dict`` slice by offsets, which
        interleaved TP blocks are not; ``distribute_tensor`` with ``src_data_rank=None``
        takes this rank's part of the full tensor every rank holds, whatever the placement.
        """
        for model, model_state in zip(components.models, state["models"], strict=True):
            for name, tensor in _named_state(model):
                _place(tensor, model_state[name])
        states = _sharding.portable_optimizer_states(state.get("optimizers"))
        for optimizer, optimizer_state in zip(components.optimizers, states or [], strict=True):
            if optimizer_state is not None:
                optimizer.load_state_dict(_placed_optimizer_state(optimizer, optimizer_state))

    @torch.no_grad()
    def load_rank0_weights(
        self, model: torch.nn.Module, weights: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """(every rank, collective) After sharding: each rank's part of rank 0's weights."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, distribute_tensor

        meta_init.materialize(model, ctx.device)
        in_files = pretrained_fill.file_backed(model)  # read by fill_from_files instead
        for name, tensor in _named_state(model):
            if name in in_files:
                continue
            full = weights[name] if ctx.world_rank == 0 else None
            if full is None:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=ctx.device)
            full = full.to(device=ctx.device, dtype=tensor.dtype).contiguous()
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                mine = distribute_tensor(
                    full, tensor.device_mesh, tensor.placements, src_data_rank=None
                )
                tensor.to_local().copy_(mine.to_local())
            else:
                tensor.copy_(full)
        # The non-persistent buffers (rotary tables) are in no state dict.
        meta_init.broadcast_from_rank0(list(model.buffers()))

    @torch.no_grad()
    def fill_from_files(self, model: torch.nn.Module) -> None:
        """(every rank) After sharding: this rank's part of each weight still in pretrained files.

        A TP placement splits by columns, by rows or in interleaved blocks (GPT-2's
        q/k/v), so no single range of the flattened tensor describes it: each rank reads
        the tensor whole and keeps its part (``distribute_tensor`` without communication).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        for param, source, key in pretrained_fill.file_backed_params(model):
            pretrained_fill.check_shape(source, key, tuple(param.shape))
            full = source.weights.read(key).reshape(param.shape)
            if isinstance(param, DTensor):
                full = full.to(device=param.device, dtype=param.dtype)
                mine = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(mine.to_local())
            else:
                param.data.copy_(full)
        pretrained_fill.forget_sources(model)


def _place(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``tensor`` (a DTensor of any placement, or plain)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(tensor, DTensor):
        tensor.copy_(full.reshape(tensor.shape))
        return
    full = full.to(device=tensor.device, dtype=tensor.dtype)
    mine = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.to_local().copy_(mine.to_local())


def _placed_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict:
    """A torch-format state whose per-element tensors are placed as their parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed = {"param_groups": state["param_groups"], "state": {}}
    for index, entry in state["state"].items():
        param = params[int(index)]
        placed["state"][index] = {
            key: distribute_tensor(
                value.to(device=param.device, dtype=param.dtype),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
            if isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    return placed


def _named_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters (each once) and persistent buffers of ``model``, by state-dict name."""
    from polytrain.checkpoint.pieces import persistent_buffers

    return [*model.named_parameters(), *persistent_buffers(model)]


def clip_grad_norm_mesh(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the 2-norm of all gradients, which may be DTensors on several meshes, to ``max_norm``.

    Returns:
        The total norm before clipping (a plain tensor, equal on every rank).
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for param in params:
        if param.grad is None:
            continue
        key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(param)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
