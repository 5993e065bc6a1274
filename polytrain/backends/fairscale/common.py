"""What both fairscale strategies share: which optimizer steps which model, and ``no_sync``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends.core.context import Components

# components.extra key: for each optimizer, the index of the model it belongs to (or None).
OWNERS = "fairscale.optimizer_owners"


def owned(components: Components) -> list[tuple[Any, torch.nn.Module | None]]:
    """``(optimizer, its model or None)`` for the optimizers in ``components``."""
    owners = components.extra.get(OWNERS)
    if owners is None:  # local mode: nothing was wrapped
        return [(o, None) for o in components.optimizers]
    return [
        (o, components.models[i] if i is not None else None)
        for o, i in zip(components.optimizers, owners, strict=True)
    ]


def no_sync(components: Components) -> contextlib.AbstractContextManager:
    """The wrappers' ``no_sync`` (gradients accumulate locally until the next sync)."""
    stack = contextlib.ExitStack()
    for model in components.models:
        if isinstance(model, wrapper_types()):
            stack.enter_context(model.no_sync())
    return stack


def wrapper_types() -> tuple[type, ...]:
    """The module wrappers either strategy may put around a model."""
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.data_parallel import ShardedDataParallel

    return (DistributedDataParallel, ShardedDataParallel, FullyShardedDataParallel)
