"""The worker side of fairscale's "oss" and "sddp" modes: OSS optimizers, DDP or ShardedDataParallel."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.ddp_signature import buffer_sync_kwargs
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.precision import Precision, default_precision
from polytrain.backends.core.strategy import TorchStrategy, stepped
from polytrain.backends.core.torch_distributed import module_device_ids
from polytrain.backends.fairscale import common
from polytrain.backends.fairscale import state as fairscale_state
from polytrain.backends.fairscale.config import FairscaleConfig
from polytrain.checkpoint.pieces import LocalState, ShardReader


class FairscaleOSSStrategy(TorchStrategy):
    """Worker side of fairscale "oss" / "sddp": OSS optimizers, models in DDP or ShardedDataParallel.

    In local mode (no process group) nothing is wrapped and the plain torch
    behaviour of :class:`~polytrain.backends.core.strategy.TorchStrategy` applies.
    """

    config: FairscaleConfig

    # ------------------------------------------------------------ preparation
    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: fp16/bf16 with ``use_fp16``; fairscale's ShardedGradScaler for fp16 on GPU.

        The scaler's inf checks span the shards.
        """
        scaler = None
        if ctx.use_fp16 and ctx.device.type == "cuda" and not ctx.local_mode:
            from fairscale.optim.grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        return default_precision(ctx, cast_forward=True, scaler=scaler)

    @sharded_only
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: rebuild the optimizers as OSS and wrap the models for the configured mode.

        In local mode (no process group) nothing is wrapped.
        """
        from fairscale.optim import OSS

        def to_oss(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            return _sharding.rebuild_optimizer(
                optimizer,
                factory=lambda groups, defaults: OSS(groups, optim=type(optimizer), **defaults),
            )

        _sharding.replace_optimizers(components, to_oss)
        owners = [_sharding.owner_index(o, components.models) for o in components.optimizers]
        components.extra[common.OWNERS] = owners
        components.models = [
            self._wrap(
                model,
                [o for o, i in zip(components.optimizers, owners, strict=True) if i == index],
                ctx,
            )
            for index, model in enumerate(components.models)
        ]
        return components

    def _wrap(
        self, model: torch.nn.Module, optimizers: list[Any], ctx: WorkerContext
    ) -> torch.nn.Module:
        if not _sharding.trainable(model):
            return model
        if self.config.mode == "sddp" and optimizers:
            from fairscale.nn.data_parallel import ShardedDataParallel

            return ShardedDataParallel(
                model,
                optimizers,
                broadcast_buffers=self.config.broadcast_buffers,
                reduce_buffer_size=self.config.reduce_buffer_size,
            )
        # "oss", or a trainable model no optimizer steps: gradients all-reduced as in ddp.
        return DistributedDataParallel(
            model,
            device_ids=module_device_ids(ctx),
            **buffer_sync_kwargs(self.config.broadcast_buffers),
        )

    # ------------------------------------------------------------------- step
    def zero_grad(self, components: Components) -> None:
        """Worker: zero in place through ShardedDataParallel in "sddp" mode.

        ``OSS.zero_grad()`` inherits torch's ``set_to_none=True``, which detaches the
        gradients from ShardedDataParallel's reduce buckets and silently corrupts
        training from the second step on; the wrapper's own ``zero_grad`` zeroes the
        buckets in place.
        """
        from fairscale.nn.data_parallel import ShardedDataParallel

        done: set[int] = set()
        for optimizer, model in common.owned(components):
            if isinstance(model, ShardedDataParallel):
                if id(model) not in done:
                    model.zero_grad()
                    done.add(id(model))
            else:
                optimizer.zero_grad()

    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: clip through ``OSS.clip_grad_norm``, which reduces the norm over the shards.

        Each rank holds the reduced gradients of its own shard; gradients are unscaled
        first. Every optimizer, or the one ``optimizer_index`` names. Local mode: plain torch.
        """
        if components.extra.get(common.OWNERS) is None:
            return super().clip_grad_norm_(components, max_norm, optimizer_index)
        optimizers = stepped(components, optimizer_index)
        (components.precision or Precision()).unscale_(optimizers)
        norms = [optimizer.clip_grad_norm(max_norm) for optimizer in optimizers]
        return torch.linalg.vector_norm(torch.stack([torch.as_tensor(n).float() for n in norms]))

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: the wrappers' ``no_sync`` (gradients accumulate locally until the next sync)."""
        return common.no_sync(components)

    # ------------------------------------------------------------------ state
    @sharded_only
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): the consolidated model and optimizer states.

        OSS shards are gathered on rank 0 (``consolidate_state_dict``); fairscale's
        state is already in torch's format (integer keys in param-group order), so
        it loads into a plain torch optimizer of the same class.
        """
        optimizers = fairscale_state.consolidate_oss_states(components.optimizers, ctx.world_rank)
        if ctx.world_rank != 0:
            return None
        return {
            "models": [self.unwrap_model(m).state_dict() for m in components.models],
            "optimizers": optimizers,
        }

    @sharded_only
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank): load a consolidated torch-format state; each rank keeps its shard."""
        fairscale_state.load_full_state(
            components, state, [self.unwrap_model(m) for m in components.models], fsdp_mode=False
        )

    @sharded_only
    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: replicated models and this rank's OSS shard, as they are (no gather)."""
        return fairscale_state.oss_local_state(self, components, ctx)

    @sharded_only
    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: whole models, and only this rank's OSS shard of each optimizer state."""
        fairscale_state.oss_load(self, components, reader)
