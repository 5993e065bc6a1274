"""A strategy's share of a checkpoint directory: its :class:`LocalState`, and loading one.

Strategies with their own shard layout implement ``sharded_state_dict`` /
``load_sharded_state_dict``; the functions here pick that hook or fall back to a
replicated copy or a state gathered on rank 0 (worker side). The format itself
(:class:`~polytrain.checkpoint.pieces.Piece`, :class:`~polytrain.checkpoint.pieces.LocalState`)
is :mod:`polytrain.checkpoint.pieces`.
"""

from __future__ import annotations

from typing import Any

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.checkpoint.pieces import (
    LocalState,
    ShardReader,
    assemble,
    left_out,
    split_state,
    with_left_out,
)


# ------------------------------------------------------------- strategies
def has_sharded_hooks(strategy: Any) -> bool:
    """Whether the strategy saves and loads its own shards (``sharded_state_dict``)."""
    return callable(getattr(strategy, "sharded_state_dict", None))


def local_state(strategy: Any, components: Components, ctx: WorkerContext) -> LocalState:
    """Worker (every rank; may be collective): this rank's :class:`LocalState`.

    A strategy with a ``sharded_state_dict(components, ctx)`` hook gives its own
    shards. A strategy that keeps the plain torch ``full_state_dict`` holds a full
    replicated copy on every rank (:func:`replicated_local_state`). Any other
    gathers its consolidated state on rank 0 (:func:`gathered_local_state`).
    """
    if has_sharded_hooks(strategy):
        return strategy.sharded_state_dict(components, ctx)
    if type(strategy).full_state_dict is TorchStrategy.full_state_dict:
        return replicated_local_state(strategy, components, ctx)
    return gathered_local_state(strategy, components, ctx)


def replicated_local_state(strategy: Any, components: Components, ctx: WorkerContext) -> LocalState:
    """Worker: every tensor of this rank's full copy, marked replicated (the writer spreads them)."""
    state = {
        "models": [strategy.unwrap_model(m).state_dict() for m in components.models],
        "optimizers": [o.state_dict() for o in components.optimizers],
    }
    return split_state(state, replicated=True, with_skeleton=ctx.world_rank == 0)


def gathered_local_state(strategy: Any, components: Components, ctx: WorkerContext) -> LocalState:
    """Worker (every rank, collective): the consolidated state on rank 0, which writes it alone."""
    full = strategy.full_state_dict(components, ctx)
    if ctx.world_rank != 0:
        return LocalState(pieces=[], skeleton=None)
    return split_state(full, replicated=False)


def load_local_state(
    strategy: Any, components: Components, reader: ShardReader, ctx: WorkerContext
) -> None:
    """Worker (every rank; may be collective): load a sharded checkpoint through ``reader``.

    A strategy with a ``load_sharded_state_dict(components, reader, ctx)`` hook reads
    only the ranges it holds; any other reads the whole state (:func:`load_whole`).
    """
    hook = getattr(strategy, "load_sharded_state_dict", None)
    if callable(hook):
        hook(components, reader, ctx)
        return
    load_whole(strategy, components, reader, ctx)


def load_whole(
    strategy: Any, components: Components, reader: ShardReader, ctx: WorkerContext
) -> None:
    """Worker: read the whole consolidated state and load it with ``load_full_state_dict``.

    Frozen tensors the checkpoint left out keep this rank's values (its models are whole).
    """
    full = assemble(reader.skeleton, reader, reader.paths())
    for index, model in enumerate(components.models):
        names = left_out(reader.skeleton, index)
        if names and index < len(full["models"]):
            module = strategy.unwrap_model(model)
            full["models"][index] = with_left_out(full["models"][index] or {}, module, names)
    strategy.load_full_state_dict(components, full, ctx)
