"""The worker side of fairscale's "fsdp" mode: fairscale's FullyShardedDataParallel (CUDA only)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.local_state import gathered_local_state, load_whole
from polytrain.backends.core.precision import Precision, amp_dtype, default_precision
from polytrain.backends.core.strategy import TorchStrategy, stepped
from polytrain.backends.fairscale import common
from polytrain.backends.fairscale import state as fairscale_state
from polytrain.backends.fairscale.config import FairscaleConfig
from polytrain.checkpoint.pieces import LocalState, ShardReader
from polytrain.errors import ConfigError


class FairscaleFSDPStrategy(TorchStrategy):
    """Worker side of fairscale "fsdp": parameters, gradients and optimizer state sharded.

    In local mode (no process group) nothing is wrapped and the plain torch
    behaviour of :class:`~polytrain.backends.core.strategy.TorchStrategy` applies.
    """

    config: FairscaleConfig

    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: fairscale's FSDP casts parameters and inputs itself: no autocast when sharded."""
        scaler = None
        if ctx.use_fp16 and ctx.device.type == "cuda" and not ctx.local_mode:
            from fairscale.optim.grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        return default_precision(ctx, cast_forward=not _sharding.shards(ctx), scaler=scaler)

    @sharded_only
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every trainable model in FSDP and rebuild its optimizer over the flat params."""
        from fairscale.nn import FullyShardedDataParallel

        owners = [_sharding.owner_index(o, components.models) for o in components.optimizers]
        for optimizer, owner in zip(components.optimizers, owners, strict=True):
            _require_flat_layout(optimizer, components.models[owner] if owner is not None else None)
        wrapped = [
            FullyShardedDataParallel(
                model,
                mixed_precision=ctx.use_fp16,
                compute_dtype=amp_dtype(ctx),  # bf16 or fp16 as precision= says
                reshard_after_forward=self.config.reshard_after_forward,
                compute_device=ctx.device,
            )
            if _sharding.trainable(model)
            else model
            for model in components.models
        ]
        old_optimizers = list(components.optimizers)

        def over_flat_params(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            # fairscale's FSDP flattens each module's parameters into new FlatParameters:
            # the optimizer is rebuilt over those (one group, the user's options).
            owner = owners[old_optimizers.index(optimizer)]
            if owner is None:
                return optimizer
            model = wrapped[owner]
            options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
            return _sharding.rebuild_optimizer(
                optimizer,
                factory=lambda groups, defaults: type(optimizer)(
                    [{**options, "params": list(model.parameters())}], **defaults
                ),
            )

        components.models = wrapped
        _sharding.replace_optimizers(components, over_flat_params)
        components.extra[common.OWNERS] = owners
        return components

    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: fairscale FSDP's ``clip_grad_norm_``, which reduces the norm over the shards.

        Gradients are unscaled first. Every model that an optimizer steps, or with
        ``optimizer_index`` the model of that optimizer. Local mode: plain torch.
        """
        if components.extra.get(common.OWNERS) is None:
            return super().clip_grad_norm_(components, max_norm, optimizer_index)
        (components.precision or Precision()).unscale_(stepped(components, optimizer_index))
        owned = common.owned(components)
        if optimizer_index is not None:
            owned = [owned[optimizer_index]]
        norms = [model.clip_grad_norm_(max_norm) for _, model in owned if model is not None]
        return torch.linalg.vector_norm(torch.stack([torch.as_tensor(n).float() for n in norms]))

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: FSDP's ``no_sync`` (gradients accumulate locally until the next sync)."""
        return common.no_sync(components)

    @sharded_only
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): fairscale FSDP's ``state_dict()`` gathers the parameters."""
        models = [model.state_dict() for model in components.models]
        optimizers = fairscale_state.gather_fsdp_states(common.owned(components))
        return {"models": models, "optimizers": optimizers} if ctx.world_rank == 0 else None

    @sharded_only
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank): load a consolidated torch-format state; each rank keeps its shard."""
        fairscale_state.load_full_state(components, state, components.models, fsdp_mode=True)

    @sharded_only
    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: fairscale's FSDP has no shard layout polytrain reads: the full state, gathered."""
        return gathered_local_state(self, components, ctx)

    @sharded_only
    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: whole models and optimizer states, each rank keeping its part."""
        load_whole(self, components, reader, ctx)


def _require_flat_layout(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """fairscale's FSDP keeps one param group, in the model's parameter order.

    Raises:
        ConfigError: param groups with different options, or another parameter order.
    """
    options = [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    if any(o != options[0] for o in options[1:]):
        raise ConfigError(
            f"fairscale mode='fsdp' flattens the parameters, so the optimizer cannot keep "
            f"{len(options)} param groups with different options ({type(optimizer).__name__}). "
            f"Use backend='fsdp' (PyTorch's FSDP keeps per-group options), fairscale mode "
            f"'sddp', or one param group."
        )
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if model is not None and params != [id(p) for p in model.parameters()]:
        raise ConfigError(
            f"fairscale mode='fsdp' needs the optimizer ({type(optimizer).__name__}) over all of "
            f"the model's parameters in model.parameters() order (its consolidated state is "
            f"indexed that way); got {len(params)} parameters in another order. Create it with "
            f"model.parameters(), or use backend='fsdp'."
        )
