"""Helpers shared by the sharding backends (``fairscale`` and ``fsdp``).

The trainer builds the optimizers with the user's creator *before* the strategy
prepares the models. A sharding backend must own an optimizer over the sharded
parameters instead (fairscale's ``OSS``, an optimizer over FSDP's local shards),
so it rebuilds each optimizer with the same class, defaults and per-group
options, and points the schedulers at the new one.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.errors import ConfigError

logger = logging.getLogger(__name__)

#: ``(param_groups, defaults) -> optimizer``: how a backend builds the replacement.
OptimizerFactory = Callable[[list[dict[str, Any]], dict[str, Any]], torch.optim.Optimizer]


def shards(ctx: WorkerContext) -> bool:
    """Worker: True when the models are wrapped, i.e. a process group is up (not local mode)."""
    return not ctx.local_mode and dist.is_available() and dist.is_initialized()


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``defaults`` that its class's constructor accepts as keywords.

    Most torch optimizers store exactly their keyword arguments in ``defaults``;
    filtering by the signature keeps third-party classes whose ``defaults`` hold
    extra bookkeeping constructible.
    """
    cls = type(optimizer)
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters and k != "params"}


def param_groups_over(
    optimizer: torch.optim.Optimizer, param_map: dict[int, torch.nn.Parameter] | None = None
) -> list[dict[str, Any]]:
    """Copies of the optimizer's param groups (every option kept), params looked up in ``param_map``.

    Args:
        optimizer: the optimizer the user's creator returned.
        param_map: ``id(old_param) -> new_param``; params missing from it are kept.
    """
    param_map = param_map or {}
    groups = []
    for group in optimizer.param_groups:
        new_group = {k: v for k, v in group.items() if k != "params"}
        new_group["params"] = [param_map.get(id(p), p) for p in group["params"]]
        groups.append(new_group)
    return groups


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    param_map: dict[int, torch.nn.Parameter] | None = None,
    factory: OptimizerFactory | None = None,
) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class, defaults and param-group options over new params.

    Args:
        optimizer: the optimizer to replace (its state, normally empty before training,
            is not carried over).
        param_map: ``id(old_param) -> new_param`` for wrappers that replace parameters.
        factory: ``(param_groups, defaults) -> optimizer``; the default calls the
            optimizer's own class.

    Returns:
        The new optimizer.
    """
    if optimizer.state:
        logger.warning(
            "Optimizer %s already holds state before training; the sharded replacement "
            "starts fresh (load a checkpoint after the trainer starts to restore it).",
            type(optimizer).__name__,
        )
    groups = param_groups_over(optimizer, param_map)
    defaults = constructor_defaults(optimizer)
    if factory is None:
        return type(optimizer)(groups, **defaults)
    return factory(groups, defaults)


def replace_optimizers(
    components: Components,
    rebuild: Callable[[torch.optim.Optimizer], torch.optim.Optimizer],
) -> None:
    """Worker: replace every optimizer with ``rebuild(optimizer)`` and rebind the schedulers."""
    replaced = {}
    new_optimizers = []
    for optimizer in components.optimizers:
        new = rebuild(optimizer)
        replaced[id(optimizer)] = (optimizer, new)
        new_optimizers.append(new)
    components.optimizers = new_optimizers
    for scheduler in components.schedulers:
        old = getattr(scheduler, "optimizer", None)
        if old is not None and id(old) in replaced:
            _rebind_scheduler(scheduler, *replaced[id(old)])


def _rebind_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> None:
    scheduler.optimizer = new
    # torch's LRScheduler wraps optimizer.step to warn about steps taken in the wrong
    # order; without the same marker on the new optimizer it would warn wrongly once.
    if hasattr(old.step, "_wrapped_by_lr_sched") and not hasattr(new.step, "_wrapped_by_lr_sched"):
        optimizer_ref = weakref.ref(new)
        step = type(new).step

        @functools.wraps(step)
        def tracked_step(*args: Any, **kwargs: Any) -> Any:
            opt = optimizer_ref()
            opt._opt_called = True  # type: ignore[union-attr]
            return step(opt, *args, **kwargs)

        tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = tracked_step  # type: ignore[method-assign]


def trainable(model: torch.nn.Module) -> bool:
    """True when the model has a parameter that requires gradients."""
    return any(p.requires_grad for p in model.parameters())


def owner_index(optimizer: torch.optim.Optimizer, models: Sequence[torch.nn.Module]) -> int | None:
    """The index of the one model holding all of the optimizer's parameters (None: no model).

    Raises:
        ConfigError: the optimizer's parameters are spread over several models.
    """
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [
        index for index, model in enumerate(models) if params & {id(p) for p in model.parameters()}
    ]
    if len(owners) > 1:
        raise ConfigError(
            f"Optimizer {type(optimizer).__name__} holds parameters of several models (model "
            f"indices {owners}); a sharding backend needs one optimizer per model. Create one "
            f"optimizer per model in optimizer_creator."
        )
    return owners[0] if owners else None


def optimizer_param_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The names (``names[id(param)]``) of the optimizer's params, in ``state_dict`` index order.

    Raises:
        ConfigError: a parameter of the optimizer is not in ``names``.
    """
    result = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ConfigError(
                    f"Optimizer {type(optimizer).__name__} holds a parameter (shape "
                    f"{tuple(param.shape)}) that is not in its model; a sharding backend "
                    f"can only shard the parameters of the model it wraps."
                )
            result.append(names[id(param)])
    return result


def named_param_ids(model: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> fully qualified name`` for every parameter of the model."""
    return {id(p): name for name, p in model.named_parameters()}


def portable_optimizer_states(states: Iterable[Any] | None) -> list[Any] | None:
    """The checkpoint's optimizer states, or None (logged) when it has none to load."""
    states = list(states or [])
    if not states:
        logger.warning("The checkpoint has no optimizer state; optimizers start fresh.")
        return None
    return states
