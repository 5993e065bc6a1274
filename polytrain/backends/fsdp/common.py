"""What both FSDP versions share, by composition: optimizers over the shards, full and sharded state.

A strategy of either version holds a :class:`ShardedStates` and hands it an
:class:`FSDPVersion`, the four things the versions do differently: wrapping a
model, telling a sharded model, this rank's range of each parameter, and the
options of ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from polytrain.backends.core import meta_init, pretrained_fill
from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.fsdp import state_v1 as fsdp_state
from polytrain.checkpoint.pieces import LocalState, ShardReader

#: How a user turns rank-0 initialisation off (named in errors).
INIT_ON_RANK0_OFF = 'backend_config={"init_on_rank0": False}'

# components.extra keys: per optimizer, the index of its model and its params' names.
_OWNERS = "fsdp.optimizer_owners"
_NAMES = "fsdp.optimizer_param_names"


class FSDPVersion(Protocol):
    """What differs between FSDP1 and FSDP2 (implemented by their strategies)."""

    #: optimizer state read back from a sharded directory -> its layout (None: as read)
    loaded_state_layout: Any

    def wrap(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        """Shard ``model`` (FSDP1 wraps it, FSDP2 shards it in place)."""

    def is_sharded(self, model: torch.nn.Module) -> bool:
        """Whether ``prepare`` sharded ``model``."""

    def ranges(self, model: torch.nn.Module) -> dict[int, fsdp_state.ParamRange] | None:
        """This rank's range of every parameter of a sharded ``model`` (None: not sharded)."""

    def state_dict_options(self, ctx: WorkerContext, saving: bool) -> Any:
        """``StateDictOptions`` for a full state dict."""


class ShardedStates:
    """Optimizers rebuilt over the sharded parameters, and the states of sharded models.

    Every method runs on a worker with a process group (the strategies handle local mode).
    """

    def __init__(self, version: FSDPVersion) -> None:
        self.version = version
        #: Whether the models were built in full on rank 0 only (the others: on meta).
        self.rank0_init = False

    def build_models(
        self,
        create: Callable[[], Sequence[torch.nn.Module]],
        ctx: WorkerContext,
        init_on_rank0: bool,
        fallback: Callable[[], Sequence[torch.nn.Module]],
    ) -> Sequence[torch.nn.Module]:
        """Rank 0 builds the models in full (on the CPU: sharding moves them unit by unit to
        the device); the other ranks on the meta device. ``fallback``: every rank in full."""
        # One worker holds the full model anyway: nothing to save.
        if not (init_on_rank0 and _sharding.shards(ctx) and ctx.world_size > 1):
            return fallback()
        self.rank0_init = True
        if ctx.world_rank == 0:
            with pretrained_fill.building("empty"):  # polytrain.hf.from_pretrained: nothing read
                return create()
        return meta_init.build_on_meta(create, ctx, INIT_ON_RANK0_OFF)

    def rank0_weights(self, model: torch.nn.Module, ctx: WorkerContext) -> dict[str, Any] | None:
        """Before sharding: rank 0's full state (``{}`` elsewhere); None without rank-0 init.

        Parameters still in pretrained files are left out: every rank reads its shards
        of them after sharding (:func:`fill_from_files`).
        """
        if not self.rank0_init:
            return None
        if ctx.world_rank != 0:
            return {}
        backed = pretrained_fill.file_backed(model)
        return {k: v for k, v in model.state_dict().items() if k not in backed}

    def load_rank0_weights(
        self, model: torch.nn.Module, weights: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """(every rank, collective) After sharding: each rank's shards of rank 0's weights.

        Buffers are broadcast too: the non-persistent ones (not in a state dict, e.g.
        rotary tables) are uninitialised memory on the ranks that built on meta.
        Parameters still in pretrained files are not in rank 0's weights.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        meta_init.materialize(model, ctx.device)
        partial = pretrained_fill.has_file_weights(model)
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=not partial
        )
        set_model_state_dict(model, weights, options=options)
        meta_init.broadcast_from_rank0(list(model.buffers()))

    def fill_from_files(self, model: torch.nn.Module) -> None:
        """(every rank) After sharding: this rank's shards of the weights still in pretrained files."""
        pretrained_fill.fill_ranges(model, self.version.ranges(model))

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Shard every trainable model; rebuild the optimizers over its shards.

        The optimizers the creator built hold the full parameters; each is replaced
        by one of the same class, defaults and param groups (per-group options kept)
        over the sharded model's parameters, and the schedulers are rebound to it.
        """
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
                if self.rank0_init:  # never sharded: whole on every rank, rank 0's weights
                    meta_init.load_whole_from_rank0(model, ctx.device)
                pretrained_fill.fill_whole(model)
                wrapped.append(model)
                continue
            fsdp_model = self.version.wrap(model, ctx)
            param_map.update(_param_map(names, fsdp_model))
            wrapped.append(fsdp_model)
        components.models = wrapped
        _sharding.replace_optimizers(
            components, lambda optimizer: _sharding.rebuild_optimizer(optimizer, param_map)
        )
        components.extra[_OWNERS] = owners
        components.extra[_NAMES] = param_names
        return components

    def owned(
        self, components: Components
    ) -> list[tuple[torch.optim.Optimizer, torch.nn.Module | None, list[str] | None]]:
        """``(optimizer, its model or None, its params' names)`` for every optimizer."""
        owners = components.extra[_OWNERS]
        names = components.extra[_NAMES]
        return [
            (o, components.models[i] if i is not None else None, n)
            for o, i, n in zip(components.optimizers, owners, names, strict=True)
        ]

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """(all ranks, collective) Full model and optimizer states in torch's format, on rank 0."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = self.version.state_dict_options(ctx, saving=True)
        models = [
            get_model_state_dict(m, options=options)
            if self.version.is_sharded(m)
            else m.state_dict()
            for m in components.models
        ]
        optimizers = []
        for optimizer, model, names in self.owned(components):
            if model is None or not self.version.is_sharded(model):
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
        """(every rank, collective) Load a full torch-format state; each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = self.version.state_dict_options(ctx, saving=False)
        for model, model_state in zip(components.models, state["models"], strict=True):
            if self.version.is_sharded(model):
                set_model_state_dict(model, model_state, options=options)
            else:
                model.load_state_dict(model_state)
        states = _sharding.portable_optimizer_states(state.get("optimizers"))
        if states is None:
            return
        for (optimizer, model, names), optimizer_state in zip(
            self.owned(components), states, strict=True
        ):
            if optimizer_state is None:
                continue
            if model is None or not self.version.is_sharded(model):
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
        """This rank's shards of the models and optimizers, as they are (no gather)."""
        return fsdp_state.fsdp_local_state(
            self.owned(components), components, ctx, ranges_of=self.version.ranges
        )

    def load_sharded_state_dict(
        self, components: Components, reader: ShardReader, ctx: WorkerContext
    ) -> None:
        """Read only this rank's ranges of a sharded checkpoint from any backend."""
        fsdp_state.fsdp_load(
            self.owned(components),
            components,
            reader,
            self.version.ranges,
            self.version.loaded_state_layout,
        )


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


class ShardedTorchStrategy(TorchStrategy):
    """The base of both FSDP versions' strategies: their ``states`` builds the models."""

    states: ShardedStates

    def build_models(
        self, create: Callable[[], Sequence[Any]], ctx: WorkerContext
    ) -> Sequence[Any]:
        """Worker: with ``init_on_rank0``, the full model on rank 0 only (the others: meta)."""
        full_everywhere = super().build_models
        return self.states.build_models(
            create, ctx, bool(self.config.init_on_rank0), lambda: full_everywhere(create, ctx)
        )
