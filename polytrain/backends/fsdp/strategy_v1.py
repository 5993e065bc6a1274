"""The worker side of ``fsdp`` version 1: ``FullyShardedDataParallel`` (legacy)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from polytrain.backends.core import meta_init
from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.precision import Precision, amp_dtype, default_precision
from polytrain.backends.core.strategy import stepped
from polytrain.backends.fsdp import state_v1 as fsdp_state
from polytrain.backends.fsdp import wrap as fsdp_wrap
from polytrain.backends.fsdp.common import (
    ShardedStates,
    ShardedTorchStrategy,
    broadcast_from_rank0,
)
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.checkpoint.pieces import LocalState, ShardReader


class FSDP1Strategy(ShardedTorchStrategy):
    """Worker side of ``fsdp`` version 1: models wrapped in FSDP1, optimizers over their shards.

    In local mode (no process group) nothing is wrapped and the plain torch
    behaviour of :class:`~polytrain.backends.core.strategy.TorchStrategy` applies.
    The optimizers and the checkpoint code are shared with FSDP2 through
    :class:`~polytrain.backends.fsdp.common.ShardedStates`; this class is the FSDP1
    :class:`~polytrain.backends.fsdp.common.FSDPVersion` it is given.
    """

    config: FSDPConfig
    loaded_state_layout: Any = None  # FSDP1's optimizer state is read back as it is

    def __init__(self, config: FSDPConfig | None = None) -> None:
        super().__init__(config if config is not None else FSDPConfig())
        self.states = ShardedStates(self)

    # ------------------------------------------------------------ preparation
    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: fp16/bf16 with ``use_fp16``; FSDP's ShardedGradScaler for fp16 on GPU.

        The scaler's inf checks span the shards. When the models are sharded, FSDP's
        MixedPrecision casts parameters and inputs itself: the forward runs without
        autocast.
        """
        scaler = None
        if ctx.use_fp16 and ctx.device.type == "cuda" and not ctx.local_mode:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        return default_precision(ctx, cast_forward=not _sharding.shards(ctx), scaler=scaler)

    @sharded_only
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every trainable model in FSDP; rebuild the optimizers over its shards.

        In local mode (no process group) nothing is wrapped.
        """
        return self.states.prepare(components, ctx)

    def wrap(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        weights = self.states.rank0_weights(model, ctx)
        sync = self.config.sync_module_states and weights is None
        if sync and ctx.device.type == "cpu":
            # FSDP's own sync_module_states insists on an accelerator: broadcast here.
            broadcast_from_rank0(model)
            sync = False
        policy = fsdp_wrap.fsdp1_policy(
            model, self.config.auto_wrap_policy, self.config.min_num_params
        )
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[self.config.sharding_strategy],
            auto_wrap_policy=policy,
            mixed_precision=self._mixed_precision(ctx),
            device_id=ctx.device,
            sync_module_states=sync,
            forward_prefetch=self.config.forward_prefetch,
            limit_all_gathers=self.config.limit_all_gathers,
            use_orig_params=True,
            # Ranks that built on meta: storage module by module, rank 0's values below.
            param_init_fn=meta_init.meta_param_init_fn(ctx.device) if weights is not None else None,
        )
        if weights is not None:
            self.states.load_rank0_weights(wrapped, weights, ctx)
        self.states.fill_from_files(wrapped)
        return wrapped

    @staticmethod
    def _mixed_precision(ctx: WorkerContext) -> Any:
        dtype = amp_dtype(ctx)  # fp16 (with a ShardedGradScaler) or bf16; None: fp32
        if dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecision

        # Buffers (e.g. BatchNorm statistics) stay in full precision.
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)

    # ------------------------------------------------------------------- step
    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: clip every sharded model with FSDP1's ``clip_grad_norm_`` (after unscaling).

        FSDP1 leaves each rank the gradients of its own shard: torch's
        ``clip_grad_norm_`` over them would measure one rank's part only, FSDP1's
        all-reduces the squared norms first. Unsharded models (local mode) use plain
        torch. With several sharded models each is clipped to ``max_norm`` on its own;
        the returned norm is the global one over all of them. ``optimizer_index``:
        only the model that optimizer steps.
        """
        models = components.models
        if optimizer_index is not None:
            owner = _sharding.owner_index(components.optimizers[optimizer_index], models)
            models = [models[owner]] if owner is not None else []
        sharded = [model for model in models if self.is_sharded(model)]
        if not sharded:
            return super().clip_grad_norm_(components, max_norm, optimizer_index)
        (components.precision or Precision()).unscale_(stepped(components, optimizer_index))
        norms = [model.clip_grad_norm_(max_norm) for model in sharded]
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: FSDP's ``no_sync`` (unsharded gradients accumulate until the next sync)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        stack = contextlib.ExitStack()
        for model in components.models:
            if isinstance(model, FullyShardedDataParallel):
                stack.enter_context(model.no_sync())
        return stack

    # ------------------------------------------------------------------ state
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Worker: the user's module (its submodules may still hold nested FSDP units)."""
        return getattr(model, "module", model)

    @sharded_only
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): full model and optimizer states, in torch's format.

        On GPU the gathered tensors are offloaded to CPU and only rank 0 keeps them;
        on CPU every rank materialises them briefly (torch's CPU offload path crashes
        when the tensors already are on the CPU).
        """
        return self.states.full_state_dict(components, ctx)

    @sharded_only
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank, collective): load a full torch-format state; each rank keeps its shard."""
        self.states.load_full_state_dict(components, state, ctx)

    @sharded_only
    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: this rank's shards of the models and optimizers, as they are (no gather).

        See :mod:`polytrain.backends.fsdp.state_v1`.
        """
        return self.states.sharded_state_dict(components, ctx)

    @sharded_only
    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: read only this rank's ranges of a sharded checkpoint from any backend."""
        self.states.load_sharded_state_dict(components, reader, ctx)

    # ------------------------------------------------- the FSDPVersion protocol
    def is_sharded(self, model: torch.nn.Module) -> bool:
        """Whether :meth:`prepare` wrapped ``model``."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)

    def ranges(self, model: torch.nn.Module) -> dict[int, fsdp_state.ParamRange] | None:
        """This rank's range of every parameter of a sharded ``model``."""
        return fsdp_state.fsdp1_ranges(model)

    def state_dict_options(self, ctx: WorkerContext, saving: bool) -> Any:
        """Full state dicts, offloaded to CPU when saving on GPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # On CPU, FSDP1's offload path crashes on tensors that already are on the CPU.
        return StateDictOptions(
            full_state_dict=True, cpu_offload=saving and ctx.device.type == "cuda"
        )
