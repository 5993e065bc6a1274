"""fairscale sharded training: optimizer-state sharding (OSS), ShardedDataParallel, or FSDP on GPU.

Modes (``backend_config={"mode": ...}``):

* ``"oss"``: the optimizer state is partitioned over the ranks with
  ``fairscale.optim.OSS`` (ZeRO-1); gradients are all-reduced by plain
  ``DistributedDataParallel``.
* ``"sddp"`` (default): OSS plus ``ShardedDataParallel``, which reduces each
  gradient only to the rank that owns its optimizer shard (ZeRO-2).
* ``"fsdp"``: fairscale's ``FullyShardedDataParallel`` (parameters, gradients
  and optimizer state sharded). It runs on CUDA only; on CPU use
  ``backend="fsdp"`` (PyTorch's FSDP).

The user's optimizer is rebuilt as ``OSS`` with its class, defaults and param
groups (per-group options such as ``lr`` are kept); schedulers are pointed at
the new optimizer. Checkpoints are consolidated to plain torch format (see
:mod:`polytrain.backends.fairscale_state`): a state saved here loads into a
plain torch optimizer of the same class, and a plain torch state (e.g. from
``ddp``) loads here at any world size.

The driver side is :class:`~polytrain.backends.torch_distributed.TorchDistributedRendezvous`
(one gloo or nccl process group); the worker side is :class:`FairscaleStrategy`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends import _sharding, fairscale_state
from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.ddp import buffer_sync_kwargs
from polytrain.backends.precision import Precision, default_precision
from polytrain.backends.shard_state import (
    LocalState,
    ShardReader,
    gathered_local_state,
    load_whole,
    replicated_local_state,
)
from polytrain.backends.strategy import TorchStrategy
from polytrain.backends.torch_distributed import TorchDistributedRendezvous, module_device_ids
from polytrain.errors import ConfigError

MODES = ("oss", "sddp", "fsdp")

# components.extra key: for each optimizer, the index of the model it belongs to (or None).
_OWNERS = "fairscale.optimizer_owners"


@dataclass
class FairscaleConfig(BackendConfig):
    """Options of the ``fairscale`` backend.

    Attributes:
        mode: "sddp" (OSS + ShardedDataParallel, default), "oss" (OSS + DDP) or "fsdp"
            (fairscale FullyShardedDataParallel, GPU only).
        broadcast_buffers: sync buffers (e.g. BatchNorm statistics) from rank 0 before
            every forward pass.
        reduce_buffer_size: ShardedDataParallel's gradient bucket size in elements
            (0 disables bucketing); "sddp" only.
        reshard_after_forward: free the gathered parameters after the forward pass
            (ZeRO-3; False keeps them until backward, ZeRO-2 style); "fsdp" only.
    """

    mode: str = "sddp"
    broadcast_buffers: bool = True
    reduce_buffer_size: int = 2**23
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"The provided mode ({self.mode!r}) is not supported. Must be one of "
                f"{', '.join(repr(m) for m in MODES)}: 'oss' (optimizer-state sharding + DDP), "
                f"'sddp' (OSS + ShardedDataParallel) or 'fsdp' (FullyShardedDataParallel, GPU "
                f"only)."
            )
        if self.reduce_buffer_size < 0:
            raise ConfigError(
                f"reduce_buffer_size must be >= 0 (elements; 0 disables bucketing); got "
                f"{self.reduce_buffer_size!r}."
            )


class FairscaleStrategy(TorchStrategy):
    """Worker side of ``fairscale``: OSS optimizers and a wrapper per the configured mode.

    In local mode (no process group) nothing is wrapped and the plain torch
    behaviour of :class:`~polytrain.backends.strategy.TorchStrategy` applies.
    """

    config: FairscaleConfig

    # ------------------------------------------------------------ preparation
    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: fp16/bf16 with ``use_fp16``; fairscale's ShardedGradScaler for fp16 on GPU.

        The scaler's inf checks span the shards. fairscale's FSDP casts parameters
        and inputs itself, so in mode "fsdp" the forward runs without autocast.
        """
        scaler = None
        if ctx.use_fp16 and ctx.device.type == "cuda" and not ctx.local_mode:
            from fairscale.optim.grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        wrapper_casts = self.config.mode == "fsdp" and _sharding.shards(ctx)
        return default_precision(ctx, cast_forward=not wrapper_casts, scaler=scaler)

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: rebuild the optimizers sharded and wrap the models for the configured mode.

        In local mode (no process group) nothing is wrapped.
        """
        if not _sharding.shards(ctx):
            return components
        if self.config.mode == "fsdp":
            return self._prepare_fsdp(components, ctx)
        from fairscale.optim import OSS

        def to_oss(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            return _sharding.rebuild_optimizer(
                optimizer,
                factory=lambda groups, defaults: OSS(groups, optim=type(optimizer), **defaults),
            )

        _sharding.replace_optimizers(components, to_oss)
        owners = [_sharding.owner_index(o, components.models) for o in components.optimizers]
        components.extra[_OWNERS] = owners
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

    def _prepare_fsdp(self, components: Components, ctx: WorkerContext) -> Components:
        from fairscale.nn import FullyShardedDataParallel

        owners = [_sharding.owner_index(o, components.models) for o in components.optimizers]
        for optimizer, owner in zip(components.optimizers, owners, strict=True):
            _require_flat_layout(optimizer, components.models[owner] if owner is not None else None)
        wrapped = [
            FullyShardedDataParallel(
                model,
                mixed_precision=ctx.use_fp16,
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
        components.extra[_OWNERS] = owners
        return components

    def _owned(self, components: Components) -> list[tuple[Any, torch.nn.Module | None]]:
        """``(optimizer, its model or None)`` for the optimizers in ``components``."""
        owners = components.extra.get(_OWNERS)
        if owners is None:  # local mode: nothing was wrapped
            return [(o, None) for o in components.optimizers]
        return [
            (o, components.models[i] if i is not None else None)
            for o, i in zip(components.optimizers, owners, strict=True)
        ]

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
        for optimizer, model in self._owned(components):
            if isinstance(model, ShardedDataParallel):
                if id(model) not in done:
                    model.zero_grad()
                    done.add(id(model))
            else:
                optimizer.zero_grad()

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: the wrappers' ``no_sync`` (gradients accumulate locally until the next sync)."""
        stack = contextlib.ExitStack()
        for model in components.models:
            if isinstance(model, _wrapper_types()):
                stack.enter_context(model.no_sync())
        return stack

    # ------------------------------------------------------------------ state
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): the consolidated model and optimizer states.

        OSS shards are gathered on rank 0 (``consolidate_state_dict``); fairscale's
        state is already in torch's format (integer keys in param-group order), so
        it loads into a plain torch optimizer of the same class.
        """
        if not _sharding.shards(ctx):
            return super().full_state_dict(components, ctx)
        if self.config.mode == "fsdp":
            # fairscale FSDP's state_dict() gathers the full parameters (collective).
            models = [model.state_dict() for model in components.models]
            optimizers = fairscale_state.gather_fsdp_states(self._owned(components))
            return {"models": models, "optimizers": optimizers} if ctx.world_rank == 0 else None
        optimizers = fairscale_state.consolidate_oss_states(components.optimizers, ctx.world_rank)
        if ctx.world_rank != 0:
            return None
        return {
            "models": [self.unwrap_model(m).state_dict() for m in components.models],
            "optimizers": optimizers,
        }

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank): load a consolidated torch-format state; each rank keeps its shard."""
        if not _sharding.shards(ctx):
            super().load_full_state_dict(components, state, ctx)
            return
        fsdp_mode = self.config.mode == "fsdp"
        for model, model_state in zip(components.models, state["models"], strict=True):
            target = model if fsdp_mode else self.unwrap_model(model)
            target.load_state_dict(model_state)
        states = _sharding.portable_optimizer_states(state.get("optimizers"))
        if states is None:
            return
        for (optimizer, model), optimizer_state in zip(
            self._owned(components), states, strict=True
        ):
            if optimizer_state is not None:
                fairscale_state.load_optimizer_shard(optimizer, model, optimizer_state, fsdp_mode)

    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: replicated models and this rank's OSS shard, as they are (no gather).

        fairscale's FSDP (mode "fsdp") and local mode gather or copy the full state.
        """
        if not _sharding.shards(ctx):
            return replicated_local_state(self, components, ctx)
        if self.config.mode == "fsdp":
            return gathered_local_state(self, components, ctx)
        return fairscale_state.oss_local_state(self, components, ctx)

    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: whole models, and only this rank's OSS shard of each optimizer state."""
        if not _sharding.shards(ctx) or self.config.mode == "fsdp":
            load_whole(self, components, reader, ctx)
            return
        fairscale_state.oss_load(self, components, reader)


class FairscaleBackend(Backend):
    """fairscale's OSS / ShardedDataParallel (CPU and GPU) or FullyShardedDataParallel (GPU)."""

    name = "fairscale"
    preload_modules = ("torch", "torch.distributed", "fairscale")
    framework = "torch"
    config_cls = FairscaleConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = FairscaleStrategy
    config: FairscaleConfig

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: fairscale's FSDP needs CUDA.

        Raises:
            ConfigError: ``mode="fsdp"`` without ``use_gpu=True``.
        """
        if self.config.mode == "fsdp" and not use_gpu:
            raise ConfigError(
                "fairscale mode='fsdp' needs use_gpu=True: fairscale's FullyShardedDataParallel "
                "runs on CUDA only (got use_gpu=False). On CPU use backend='fsdp' (PyTorch's "
                "FullyShardedDataParallel, which also shards parameters and gradients), or "
                "fairscale mode 'sddp' or 'oss'."
            )


def _wrapper_types() -> tuple[type, ...]:
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.data_parallel import ShardedDataParallel

    return (DistributedDataParallel, ShardedDataParallel, FullyShardedDataParallel)


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
