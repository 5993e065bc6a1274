"""FSDP2, torch's ``fully_shard``: the ``fsdp`` backend's default worker side.

``fully_shard`` turns every parameter of a module into a ``DTensor`` sharded on
dim 0 over a device mesh (``init_device_mesh("cpu" | "cuda", (world_size,))``,
the default process group) and all-gathers a unit's parameters around its
forward and backward. Units are chosen as FSDP1's size-based auto-wrap policy
chooses them (:func:`wrap_units`): ``fully_shard`` is applied to each, children
before parents, then to the root. The optimizers are rebuilt after sharding, so
they hold the DTensor parameters and their state is sharded the same way.

Options map from :class:`~polytrain.backends.fsdp.config.FSDPConfig` (shared with
FSDP1): FULL_SHARD -> ``reshard_after_forward=True``, SHARD_GRAD_OP -> False
(:func:`reshard_after_forward`; NO_SHARD is refused by the config: FSDP2 always
shards); ``use_fp16`` -> ``MixedPrecisionPolicy`` with fp16 on GPU and bf16 on
CPU (:func:`mixed_precision_dtype`). fp16 gradients are scaled with
``torch.amp.GradScaler``: DTensor reduces its inf check across the mesh.

Checkpoints share FSDP1's code by composition
(:class:`~polytrain.backends.fsdp.common.ShardedStates`): full state dicts through
``torch.distributed.checkpoint.state_dict`` (gathered to rank 0 with
``cpu_offload``), sharded directories from each rank's rows
(:mod:`polytrain.backends.fsdp.state_v2`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_mode import sharded_only
from polytrain.backends.core.precision import Precision, amp_dtype, default_precision
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.fsdp import state_v1 as fsdp_state
from polytrain.backends.fsdp import state_v2 as fsdp2_state
from polytrain.backends.fsdp import wrap as fsdp_wrap
from polytrain.backends.fsdp.common import (
    ShardedStates,
    ShardedTorchStrategy,
    broadcast_from_rank0,
)
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.checkpoint.pieces import LocalState, ShardReader
from polytrain.errors import ConfigError

#: Containers that are never called: FSDP2 gathers a unit's parameters in its forward
#: hooks, so these are never units of their own (FSDP1's size policy skips them too).
_NEVER_UNITS = (torch.nn.ModuleList, torch.nn.ModuleDict)
#: Modules that use their children's parameters without calling the children: units
#: as a whole, never split (FSDP1's ``force_leaf_modules``).
_LEAVES = (torch.nn.MultiheadAttention,)

_RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def reshard_after_forward(sharding_strategy: str) -> bool:
    """``fully_shard``'s ``reshard_after_forward`` for an FSDP1 sharding strategy.

    Raises:
        ConfigError: NO_SHARD or an unknown value (FSDP2 always shards).
    """
    if sharding_strategy not in _RESHARD_AFTER_FORWARD:
        raise ConfigError(
            f"FSDP2 (fully_shard) has no sharding_strategy {sharding_strategy!r}. Use one of "
            f"{', '.join(repr(s) for s in _RESHARD_AFTER_FORWARD)}, or version 1 for NO_SHARD."
        )
    return _RESHARD_AFTER_FORWARD[sharding_strategy]


def mixed_precision_dtype(use_fp16: bool, device_type: str) -> torch.dtype | None:
    """The parameter and reduction dtype of ``use_fp16``: fp16 on GPU, bf16 on CPU (None: off).

    fp16 kernels are slow or missing on CPU, and bf16 needs no loss scaling.
    """
    if not use_fp16:
        return None
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def wrap_units(model: torch.nn.Module, auto_wrap_policy: str, min_num_params: int) -> list:
    """The submodules that get their own ``fully_shard`` call, children before parents.

    FSDP1's ``size_based_auto_wrap_policy``: walking the tree bottom-up, a submodule
    whose parameters not already in a unit below it number at least
    ``min_num_params`` becomes a unit. ``ModuleList`` / ``ModuleDict`` never do (they
    are not called), and a ``MultiheadAttention`` is never split. The root is not
    listed: it is always sharded last, holding whatever is left.

    Args:
        model: the model to shard.
        auto_wrap_policy: "size_based", "none" (no units below the root), or a block
            policy of :mod:`polytrain.backends.fsdp.wrap` ("auto" falls back to size).
        min_num_params: the size threshold.
    """
    if auto_wrap_policy == "none":
        return []
    classes = fsdp_wrap.block_classes(model, auto_wrap_policy)
    if classes:
        return fsdp_wrap.block_units(model, classes)
    units: list[torch.nn.Module] = []
    counted: set[int] = set()

    def fresh(params: Iterator[torch.nn.Parameter]) -> int:
        new = [p for p in params if id(p) not in counted]
        counted.update(id(p) for p in new)
        return sum(p.numel() for p in new)

    def visit(module: torch.nn.Module) -> int:
        if isinstance(module, _LEAVES):
            numel = fresh(module.parameters())
        else:
            numel = sum(visit(child) for child in module.children())
            numel += fresh(module.parameters(recurse=False))
        if module is not model and numel >= min_num_params and not isinstance(module, _NEVER_UNITS):
            units.append(module)
            return 0
        return numel

    visit(model)
    return units


class FSDP2Strategy(ShardedTorchStrategy):
    """Worker side of ``fsdp`` version 2: trainable models sharded with ``fully_shard``.

    In local mode (no process group) nothing is sharded and the plain torch
    behaviour applies. The bookkeeping of optimizers, their owners and names, and
    the checkpoint code are shared with FSDP1 through
    :class:`~polytrain.backends.fsdp.common.ShardedStates`; this class is the FSDP2
    :class:`~polytrain.backends.fsdp.common.FSDPVersion` it is given.
    """

    config: FSDPConfig

    def __init__(self, config: FSDPConfig | None = None) -> None:
        super().__init__(config if config is not None else FSDPConfig())
        self._mesh: Any = None
        self.states = ShardedStates(self)

    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: with ``use_fp16``, the MixedPrecisionPolicy casts; a GradScaler for fp16 on GPU.

        When the models are sharded the forward runs without autocast (the policy
        casts parameters and inputs); in local mode it is the plain autocast.
        """
        return default_precision(ctx, cast_forward=not _sharding.shards(ctx))

    @sharded_only
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: ``fully_shard`` every trainable model; rebuild the optimizers over its DTensors.

        In local mode (no process group) nothing is sharded.
        """
        return self.states.prepare(components, ctx)

    def wrap(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        """Shard the units (:func:`wrap_units`), then the root, in place (:meth:`shard`)."""
        weights = self.states.rank0_weights(model, ctx)
        if weights is None and self.config.sync_module_states:
            broadcast_from_rank0(model)
        model = self.shard(model, ctx)
        if weights is not None:
            self.states.load_rank0_weights(model, weights, ctx)
        self.states.fill_from_files(model)
        return model

    def shard(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        """``fully_shard`` the units (:func:`wrap_units`), then the root, over :meth:`_device_mesh`."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = amp_dtype(ctx)
        options = {
            "mesh": self._device_mesh(ctx),
            "reshard_after_forward": reshard_after_forward(self.config.sharding_strategy),
            # Buffers (e.g. BatchNorm statistics) are not sharded and stay in full precision.
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype),
        }
        for unit in self.units(model):
            fully_shard(unit, **options)
        return fully_shard(model, **options)

    def units(self, model: torch.nn.Module) -> list:
        """The submodules sharded as units of their own (:func:`wrap_units` of the config)."""
        return wrap_units(model, self.config.auto_wrap_policy, self.config.min_num_params)

    def _device_mesh(self, ctx: WorkerContext) -> Any:
        """The 1-D mesh over every rank on this worker's device type (the default group)."""
        if self._mesh is None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
        return self._mesh

    # ------------------------------------------------------------------- step
    # DTensor gradients: torch's clip_grad_norm_ reduces the norm across the shards.
    clip_grad_norm_ = TorchStrategy.clip_grad_norm_

    @contextlib.contextmanager
    def no_sync(self, components: Components) -> Iterator[None]:
        """Worker: no gradient reduction (FSDP2's ``set_requires_gradient_sync(False)``)."""
        sharded = [m for m in components.models if self.is_sharded(m)]
        for model in sharded:
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for model in sharded:
                model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ state
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Worker: the user's module itself (``fully_shard`` shards it in place)."""
        return model

    @sharded_only
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): full states gathered to rank 0."""
        _reshard(components)
        return self.states.full_state_dict(components, ctx)

    @sharded_only
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (every rank, collective): load a full torch-format state; each rank keeps its rows."""
        _reshard(components)
        self.states.load_full_state_dict(components, state, ctx)

    @sharded_only
    def sharded_state_dict(self, components: Components, ctx: WorkerContext) -> LocalState:
        """Worker: this rank's rows of every parameter and optimizer state (no gather)."""
        _reshard(components)
        return self.states.sharded_state_dict(components, ctx)

    @sharded_only
    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Worker: read only this rank's rows of a sharded checkpoint from any backend."""
        _reshard(components)
        self.states.load_sharded_state_dict(components, reader, ctx)

    # ------------------------------------------------- the FSDPVersion protocol
    # DTensor rows for the optimizer: its state is sharded like the parameters.
    loaded_state_layout = staticmethod(fsdp2_state.as_param_layout)

    def is_sharded(self, model: torch.nn.Module) -> bool:
        """Whether :meth:`prepare` sharded ``model``."""
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule)

    def ranges(self, model: torch.nn.Module) -> dict[int, fsdp_state.ParamRange] | None:
        """This rank's rows of every DTensor parameter of a sharded ``model``."""
        return fsdp2_state.dtensor_ranges(model) if self.is_sharded(model) else None

    def state_dict_options(self, ctx: WorkerContext, saving: bool) -> Any:
        """Full state dicts, gathered to rank 0's CPU when saving."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Gathered tensors go to the CPU of rank 0 only; the other ranks get none.
        return StateDictOptions(full_state_dict=True, cpu_offload=saving)


def _reshard(components: Components) -> None:
    """Worker: every unit back to its sharded parameters (a local operation).

    A forward without backward (validation) leaves units with
    ``reshard_after_forward=False`` holding gathered plain tensors as parameters;
    state is read and written only on the DTensor shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for model in components.models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
