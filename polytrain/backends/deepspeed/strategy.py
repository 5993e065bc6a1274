"""The worker side of the deepspeed backend: the user's model and optimizer in a DeepSpeed engine.

``deepspeed.initialize`` partitions the optimizer state (ZeRO stage 1), the
gradients (stage 2) and the parameters (stage 3) across the workers. The engine
owns back-propagation, loss scaling, gradient accumulation and mixed precision
(set in the DeepSpeed config from the trainer's ``use_fp16``), so the strategy's
precision plugin is plain full precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_state import gathered_local_state, load_whole
from polytrain.backends.core.precision import Precision
from polytrain.backends.core.step_options import MicroBatch, StepOptions
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.deepspeed import shards as deepspeed_shards
from polytrain.backends.deepspeed.env import (
    forget_deepspeed_groups,
    import_deepspeed,
    preserved_env,
    skip_unused_shm_extension,
)
from polytrain.backends.deepspeed.state import (
    ENGINE_KEY,
    EngineState,
    engine_state,
    full_model_state,
    full_optimizer_state,
    load_model_state,
    load_optimizer_state,
)
from polytrain.backends.deepspeed.zero_init import build_partitioned
from polytrain.checkpoint.pieces import LocalState, ShardReader
from polytrain.errors import ConfigError
from polytrain.launchers.pool.reset import register_reset_hook

if TYPE_CHECKING:
    from polytrain.backends.deepspeed.config import DeepSpeedConfig


@dataclass
class _DeviceArgs:
    """The ``args`` DeepSpeed reads its device from."""

    device_rank: int


class DeepSpeedStrategy(TorchStrategy):
    """Worker side of ``deepspeed``: one model and one optimizer wrapped in a DeepSpeed engine.

    The trainer keeps stepping the user's scheduler: it changes the learning rate
    in the param groups that the DeepSpeed optimizer steps.

    Args:
        config: the backend's :class:`~polytrain.backends.deepspeed.config.DeepSpeedConfig`.
    """

    config: DeepSpeedConfig

    # ------------------------------------------------------------ preparation
    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: full precision; the engine casts and scales as its config says (see prepare)."""
        return Precision()

    def build_models(
        self, create: Callable[[], Sequence[Any]], ctx: WorkerContext
    ) -> Sequence[Any]:
        """Worker: under ZeRO-3 (``init_on_rank0``), the model partitioned as it is built.

        See :mod:`polytrain.backends.deepspeed.zero_init`: no rank holds the full
        parameters but rank 0, whose full build gives every rank its weights.
        """
        if ctx.local_mode or ctx.world_size < 2 or not self.config.builds_on_rank0():
            return super().build_models(create, ctx)
        deepspeed = import_deepspeed()
        skip_unused_shm_extension()
        register_reset_hook(forget_deepspeed_groups)
        ds_config = self.config.worker_config(
            None, ctx.world_size, use_fp16=ctx.use_fp16, device_type=ctx.device.type, step=ctx.step
        )
        return build_partitioned(create, ctx, ds_config, deepspeed)

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap the model and the user's optimizer in a DeepSpeed engine.

        Raises:
            ConfigError: the creators built more than one model or optimizer, or the
                DeepSpeed config's batch sizes disagree with the trainer's.
        """
        # DeepSpeed caches sub-groups of this world in module globals: a warm worker
        # reused by another group must forget them before the world is destroyed.
        register_reset_hook(forget_deepspeed_groups)
        if len(components.models) != 1 or len(components.optimizers) != 1:
            raise ConfigError(
                f"The deepspeed backend trains one model with one optimizer; the creators "
                f"returned {len(components.models)} model(s) and {len(components.optimizers)} "
                f"optimizer(s). Combine them into one nn.Module and one optimizer (param groups "
                f"allow per-part settings), or use backend='ddp' for several."
            )
        # Local mode runs in the driver: keep its environment as it was.
        with preserved_env() if ctx.local_mode else contextlib.nullcontext():
            return self._initialize(components, ctx)

    def _initialize(self, components: Components, ctx: WorkerContext) -> Components:
        deepspeed = import_deepspeed()
        skip_unused_shm_extension()
        model = components.models[0]
        optimizer = components.optimizers[0]
        micro_batch = getattr(components.train_loader, "batch_size", None) or 1
        ds_config = self.config.worker_config(
            micro_batch,
            ctx.world_size,
            use_fp16=ctx.use_fp16,
            device_type=ctx.device.type,
            step=ctx.step,
        )
        self._step_options = ctx.step
        args = None
        if ctx.device.type == "cuda":
            # Ray's GPU index, not LOCAL_RANK, names this worker's device.
            args = _DeviceArgs(device_rank=ctx.device.index or 0)
        # Param order of the user's optimizer, before ZeRO swaps in flat partitions:
        # the index space of the torch-format optimizer state in checkpoints.
        ordered = [[p for p in group["params"]] for group in optimizer.param_groups]
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=args,
            model=model,
            optimizer=optimizer,
            config=ds_config,
            dist_init_required=False,
        )
        components.models = [engine]
        components.optimizers = [ds_optimizer]
        components.extra[ENGINE_KEY] = EngineState(engine, optimizer, ordered)
        return components

    # ------------------------------------------------------------------- step
    def zero_grad(self, components: Components) -> None:
        """Worker: nothing to do; the engine clears gradients after each optimizer step.

        Clearing them before every backward would discard the micro-batches that
        DeepSpeed accumulates towards ``gradient_accumulation_steps``.
        """

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: ``engine.backward`` (loss scaling, accumulation, ZeRO reduction)."""
        engine_state(components).engine.backward(loss)

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: ``engine.step``; it applies the update at accumulation boundaries only.

        Raises:
            ConfigError (a ``ValueError``): ``optimizer_index`` names another optimizer than the one engine's.
        """
        if optimizer_index not in (None, 0):
            raise ConfigError(
                f"The deepspeed backend has one optimizer (index 0); got "
                f"optimizer_index={optimizer_index!r}."
            )
        engine_state(components).engine.step()

    _step_options: StepOptions = StepOptions()

    def accumulation_loss(
        self, loss: torch.Tensor, components: Components, micro: MicroBatch
    ) -> torch.Tensor:
        """Worker: tell the engine whether this micro-batch ends the step; undo its division.

        ``engine.backward`` divides by the configured accumulation steps k itself;
        a remainder step of ``micro.size < k`` micro-batches is scaled by k / size so
        that it, too, averages its micro-batches. Without the trainer's
        ``gradient_accumulation_steps`` the engine counts micro-batches on its own
        (a DeepSpeed config's ``gradient_accumulation_steps``).
        """
        if not self._step_options.accumulates:
            return loss
        engine = engine_state(components).engine
        engine.set_gradient_accumulation_boundary(micro.last)
        return loss * (engine.gradient_accumulation_steps() / micro.size)

    def end_micro_batch(self, components: Components, micro: MicroBatch) -> None:
        """Worker: ``engine.step()`` after every micro-batch (it updates only at the boundary)."""
        engine_state(components).engine.step()

    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: None; the engine clips inside ``step()`` to its ``gradient_clipping``.

        Raises:
            ConfigError (a ``ValueError``): ``max_norm`` differs from the engine's ``gradient_clipping``
                (set from the trainer's ``max_grad_norm``).
        """
        clipping = engine_state(components).engine.gradient_clipping()
        if not clipping or abs(clipping - max_norm) > 1e-12:
            raise ConfigError(
                f"The deepspeed backend clips inside its engine's step to the configured "
                f"gradient_clipping ({clipping!r}); clip_grad_norm_({max_norm!r}) cannot change "
                f"it. Pass max_grad_norm={max_norm!r} to the trainer instead."
            )
        return None

    def step_grad_norm(self, components: Components) -> float | None:
        """Worker: the global norm the engine measured (before clipping) in its last step."""
        norm = engine_state(components).engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: a no-op; accumulate with ``gradient_accumulation_steps`` instead.

        DeepSpeed decides when gradients are reduced from its accumulation setting.
        """
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ state
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): consolidated fp32 weights and torch-format optimizer state.

        Weights: every entry of the user's module ``state_dict``, unsharded, fp32 for
        floating-point tensors. Optimizer: the user's optimizer's state in plain
        ``torch.optim`` format (per-parameter tensors such as Adam's ``exp_avg`` and
        ``exp_avg_sq`` or SGD's ``momentum_buffer``, gathered from the ZeRO
        partitions, plus scalars such as ``step``); ``None`` where DeepSpeed wraps
        the optimizer in a way with no faithful torch form (fp16/bf16 master weights
        at stage 0), which loads as a fresh optimizer.
        """
        state = engine_state(components)
        models = [full_model_state(state, ctx)]
        optimizers = [full_optimizer_state(state)]
        if ctx.world_rank != 0:
            return None
        return {"models": models, "optimizers": optimizers}

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (all ranks): load consolidated weights and torch-format optimizer state.

        Works for a checkpoint from any backend and world size; training continues
        from the loaded weights (and optimizer state, when the checkpoint has it).
        """
        current = engine_state(components)
        (model_state,) = state["models"]
        load_model_state(current, model_state)
        optimizer_states = state.get("optimizers") or [None]
        load_optimizer_state(current, optimizer_states[0])

    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: this rank's ZeRO partitions of weights and optimizer state (no gather).

        Stage 0 partitions nothing: rank 0 saves the consolidated state. See
        :mod:`polytrain.backends.deepspeed.shards`.
        """
        state = engine_state(components)
        if state.stage == 0:
            return gathered_local_state(self, components, ctx)
        return deepspeed_shards.local_state(state, ctx)

    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: load a sharded checkpoint from any backend into this rank's partitions."""
        state = engine_state(components)
        if state.stage == 0:
            load_whole(self, components, reader, ctx)
            return
        deepspeed_shards.load(state, reader)
