"""PyTorch FSDP: parameters, gradients and optimizer state sharded.

``backend_config={"version": ...}`` picks torch's FSDP API: ``2`` (default) is
``fully_shard`` (FSDP2: every parameter a ``DTensor`` sharded on dim 0, mixed
precision by ``MixedPrecisionPolicy``; see :mod:`polytrain.backends.fsdp2`), ``1``
the legacy ``FullyShardedDataParallel`` class (FSDP1) with ``use_orig_params=True``,
which keeps the user's parameter objects as views of the local shard and needs
``device_id=torch.device("cpu")`` on CPU. Both train on CPU with gloo and on GPU
with nccl, and take the same :class:`FSDPConfig` (NO_SHARD and FSDP1's flags:
version 1 only). Optimizers are rebuilt over the sharded parameters with every
param group and per-group option.

Full checkpoints go through ``torch.distributed.checkpoint.state_dict``, the optimizer
state re-keyed from parameter names to indices (torch's ``optimizer.state_dict()``
format). Sharded directories are read and written range by range (:mod:`.fsdp_state`).

The driver side is :class:`~polytrain.backends.torch_distributed.TorchDistributedRendezvous`;
the worker side :class:`FSDPStrategy` (version 1) or ``FSDP2Strategy`` (version 2).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends import _sharding, fsdp_state
from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.precision import Precision, default_precision
from polytrain.backends.shard_state import (
    LocalState,
    ShardReader,
    load_whole,
    replicated_local_state,
)
from polytrain.backends.strategy import Strategy, TorchStrategy
from polytrain.backends.torch_distributed import TorchDistributedRendezvous
from polytrain.errors import ConfigError, ConfigTypeError

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
AUTO_WRAP_POLICIES = ("size_based", "none")
FSDP_VERSIONS = (1, 2)

# components.extra keys: per optimizer, the index of its model and its params' names.
_OWNERS = "fsdp.optimizer_owners"
_NAMES = "fsdp.optimizer_param_names"


@dataclass
class FSDPConfig(BackendConfig):
    """Options of the ``fsdp`` backend.

    Attributes:
        version: 2 (default: ``fully_shard``, FSDP2) or 1 (``FullyShardedDataParallel``,
            FSDP1, legacy).
        sharding_strategy: "FULL_SHARD" (parameters, gradients and optimizer state
            sharded; ZeRO-3, default), "SHARD_GRAD_OP" (parameters gathered from forward
            to backward; ZeRO-2) or "NO_SHARD" (replicated, like DDP; version 1 only).
            Version 2 maps them to ``reshard_after_forward`` True and False.
        auto_wrap_policy: "size_based" (default: every submodule tree with at least
            ``min_num_params`` parameters becomes its own FSDP unit, so only one unit's
            parameters are gathered at a time) or "none" (one unit: the whole model).
        min_num_params: the size threshold of the "size_based" policy.
        sync_module_states: broadcast rank 0's parameters and buffers when wrapping.
        forward_prefetch: FSDP1's flag: gather the next unit's parameters during forward
            (True: version 1 only; FSDP2 overlaps its all-gathers by itself).
        limit_all_gathers: FSDP1's flag: bound the memory of in-flight all-gathers
            (False: version 1 only; FSDP2 always bounds it).
    """

    version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: str = "size_based"
    min_num_params: int = 100_000
    sync_module_states: bool = True
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    def __post_init__(self) -> None:
        strategy = str(self.sharding_strategy).upper()
        if strategy not in SHARDING_STRATEGIES:
            raise ConfigError(
                f"The provided sharding_strategy ({self.sharding_strategy!r}) is not supported. "
                f"Must be one of {', '.join(repr(s) for s in SHARDING_STRATEGIES)}."
            )
        self.sharding_strategy = strategy
        if self.auto_wrap_policy not in AUTO_WRAP_POLICIES:
            raise ConfigError(
                f"The provided auto_wrap_policy ({self.auto_wrap_policy!r}) is not supported. "
                f"Must be one of {', '.join(repr(p) for p in AUTO_WRAP_POLICIES)}."
            )
        if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int):
            raise ConfigTypeError(
                f"min_num_params must be a positive int; got {self.min_num_params!r}."
            )
        if self.min_num_params < 1:
            raise ConfigError(f"min_num_params must be a positive int; got {self.min_num_params}.")
        self._check_version()

    def _check_version(self) -> None:
        if type(self.version) is not int or self.version not in FSDP_VERSIONS:
            raise ConfigError(
                f"The provided version ({self.version!r}) is not supported. Must be 2 "
                f"(fully_shard, FSDP2; the default) or 1 (FullyShardedDataParallel, FSDP1)."
            )
        if self.version == 1:
            return
        v1_only = {
            "sharding_strategy": ("NO_SHARD", self.sharding_strategy == "NO_SHARD"),
            "forward_prefetch": (True, self.forward_prefetch),
            "limit_all_gathers": (False, not self.limit_all_gathers),
        }
        for name, (value, given) in v1_only.items():
            if given:
                raise ConfigError(
                    f"{name}={value!r} is an FSDP1 option: version 2 (fully_shard) has no such "
                    f"setting. Add 'version': 1 to backend_config to use it, or drop it."
                )


class FSDPStrategy(TorchStrategy):
    """Worker side of ``fsdp`` version 1: models wrapped in FSDP1, optimizers over their shards.

    In local mode (no process group) nothing is wrapped and the plain torch
    behaviour of :class:`~polytrain.backends.strategy.TorchStrategy` applies.
    """

    config: FSDPConfig

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

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every trainable model in FSDP; rebuild the optimizers over its shards.

        The optimizers the creator built hold the full parameters; each is replaced
        by one of the same class, defaults and param groups (per-group options kept)
        over the wrapped model's parameters, and the schedulers are rebound to it.
        In local mode (no process group) nothing is wrapped.
        """
        if not _sharding.shards(ctx):
            return components
        owners = [_sharding.owner_index(o, components.models) for o in components.optimizers]
        names_by_model = [_sharding.named_param_ids(m) for m in components.models]
        param_names = [
            _sharding.optimizer_param_names(o, names_by_model[i]) if i is not None else None
            for o, i in zip(components.optimizers, owners, strict=True)
        ]
        param_map: dict[int, torch.nn.Parameter] = {}
        wrapped = []
        for model, names in zip(components.models, names_by_model, strict=True):
            if not _sharding.trainable(model):
                wrapped.append(model)
                continue
            fsdp_model = self._wrap(model, ctx)
            param_map.update(_param_map(names, fsdp_model))
            wrapped.append(fsdp_model)
        components.models = wrapped
        _sharding.replace_optimizers(
            components, lambda optimizer: _sharding.rebuild_optimizer(optimizer, param_map)
        )
        components.extra[_OWNERS] = owners
        components.extra[_NAMES] = param_names
        return components

    def _wrap(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        sync = self.config.sync_module_states
        if sync and ctx.device.type == "cpu":
            # FSDP's own sync_module_states insists on an accelerator: broadcast here.
            broadcast_from_rank0(model)
            sync = False
        policy = None
        if self.config.auto_wrap_policy == "size_based":
            policy = functools.partial(
                size_based_auto_wrap_policy, min_num_params=self.config.min_num_params
            )
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[self.config.sharding_strategy],
            auto_wrap_policy=policy,
            mixed_precision=self._mixed_precision(ctx),
            device_id=ctx.device,
            sync_module_states=sync,
            forward_prefetch=self.config.forward_prefetch,
            limit_all_gathers=self.config.limit_all_gathers,
            use_orig_params=True,
        )

    @staticmethod
    def _mixed_precision(ctx: WorkerContext) -> Any:
        if not ctx.use_fp16:
            return None
        from torch.distributed.fsdp import MixedPrecision

        # fp16 on GPU (with a ShardedGradScaler); bf16 on CPU, where fp16 kernels are slow
        # or missing. Buffers (e.g. BatchNorm statistics) stay in full precision.
        dtype = torch.float16 if ctx.device.type == "cuda" else torch.bfloat16
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)

    # ------------------------------------------------------------------- step
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

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): full model and optimizer states, in torch's format.

        On GPU the gathered tensors are offloaded to CPU and only rank 0 keeps them;
        on CPU every rank materialises them briefly (torch's CPU offload path crashes
        when the tensors already are on the CPU).
        """
        if not _sharding.shards(ctx):
            return super().full_state_dict(components, ctx)
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = self._state_dict_options(ctx, saving=True)
        models = [
            get_model_state_dict(m, options=options) if self._sharded(m) else m.state_dict()
            for m in components.models
        ]
        optimizers = []
        for optimizer, model, names in self._owned(components):
            if model is None or not self._sharded(model):
                optimizers.append(optimizer.state_dict())
                continue
            fresh = not optimizer.state
            by_name = get_optimizer_state_dict(model, optimizer, options=options)
            if fresh:
                # An empty state is initialised with a zero-lr step first; undo it, or Adam's
                # first real step would count as its second.
                optimizer.state.clear()
                by_name["state"] = {}
            optimizers.append(
                fsdp_state.index_keyed(by_name, names) if ctx.world_rank == 0 else None
            )
        if ctx.world_rank != 0:
            return None
        return {"models": models, "optimizers": optimizers}

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank, collective): load a full torch-format state; each rank keeps its shard."""
        if not _sharding.shards(ctx):
            super().load_full_state_dict(components, state, ctx)
            return
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = self._state_dict_options(ctx, saving=False)
        for model, model_state in zip(components.models, state["models"], strict=True):
            if self._sharded(model):
                set_model_state_dict(model, model_state, options=options)
            else:
                model.load_state_dict(model_state)
        states = _sharding.portable_optimizer_states(state.get("optimizers"))
        if states is None:
            return
        for (optimizer, model, names), optimizer_state in zip(
            self._owned(components), states, strict=True
        ):
            if optimizer_state is None:
                continue
            if model is None or not self._sharded(model):
                optimizer.load_state_dict(optimizer_state)
                continue
            by_name = fsdp_state.name_keyed(optimizer_state, names)
            set_optimizer_state_dict(model, optimizer, by_name, options=options)
            # Loading initialises an empty state with a zero-lr step first: drop what the
            # checkpoint has no state for (e.g. an optimizer saved before its first step).
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for param, name in zip(params, names, strict=True):
                if name not in by_name["state"]:
                    optimizer.state.pop(param, None)

    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: this rank's shards of the models and optimizers, as they are (no gather).

        See :mod:`polytrain.backends.fsdp_state`.
        """
        if not _sharding.shards(ctx):
            return replicated_local_state(self, components, ctx)
        return fsdp_state.fsdp_local_state(
            self._owned(components), components, ctx, ranges_of=self._ranges
        )

    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: read only this rank's ranges of a sharded checkpoint from any backend."""
        if not _sharding.shards(ctx):
            load_whole(self, components, reader, ctx)
            return
        owned = self._owned(components)
        fsdp_state.fsdp_load(owned, components, reader, self._ranges, self._loaded_state_layout)

    # ------------------------------------------ what differs between the versions
    _loaded_state_layout: Any = None  # optimizer state read back -> its layout (None: as read)

    def _sharded(self, model: torch.nn.Module) -> bool:
        """Whether :meth:`prepare` sharded ``model``."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)

    def _ranges(self, model: torch.nn.Module) -> dict[int, fsdp_state.ParamRange] | None:
        """This rank's range of every parameter of a sharded ``model`` (None: not sharded)."""
        return fsdp_state.fsdp1_ranges(model)

    def _state_dict_options(self, ctx: WorkerContext, saving: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # On CPU, FSDP1's offload path crashes on tensors that already are on the CPU.
        return StateDictOptions(
            full_state_dict=True, cpu_offload=saving and ctx.device.type == "cuda"
        )

    def _owned(
        self, components: Components
    ) -> list[tuple[torch.optim.Optimizer, torch.nn.Module | None, list[str] | None]]:
        """``(optimizer, its model or None, its params' names)`` for every optimizer."""
        owners = components.extra[_OWNERS]
        names = components.extra[_NAMES]
        return [
            (o, components.models[i] if i is not None else None, n)
            for o, i, n in zip(components.optimizers, owners, names, strict=True)
        ]


class FSDPBackend(Backend):
    """PyTorch FSDP: ``fully_shard`` (FSDP2, default) or ``FullyShardedDataParallel`` (gloo / nccl)."""

    name = "fsdp"
    preload_modules = ("torch", "torch.distributed", "torch.distributed.fsdp")
    config_cls = FSDPConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = FSDPStrategy
    config: FSDPConfig

    def make_strategy(self) -> Strategy:
        """Worker: :class:`~polytrain.backends.fsdp2.FSDP2Strategy` (version 2) or FSDP1's."""
        if self.config.version == 1:
            return FSDPStrategy(self.config)
        from polytrain.backends.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(self.config)


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Worker (every rank, collective): rank 0's parameters and buffers everywhere."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _param_map(names: dict[int, str], fsdp_model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """``id(original param) -> the wrapped model's param`` by name.

    FSDP1 with ``use_orig_params=True`` keeps the parameter objects (the identity);
    FSDP2 replaces each with a DTensor parameter of the same name.
    """
    by_name = {fsdp_state.clean_name(n): p for n, p in fsdp_model.named_parameters()}
    return {pid: by_name[name] for pid, name in names.items() if name in by_name}
