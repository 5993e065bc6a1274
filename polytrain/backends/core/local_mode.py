"""A sharding strategy in local mode (no process group) does what the replicated one does.

The fsdp, fairscale and DeepSpeed-AutoTP strategies shard only inside a process
group. Without one (the creator API's and the function API's local mode, one
process) their models are whole and unwrapped, and every hook that would shard,
gather or split must behave as :class:`~polytrain.backends.core.strategy.TorchStrategy`'s.
:func:`sharded_only` says so once per hook, with the replicated behaviour kept
here in one table, instead of an if-statement at the top of each method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from polytrain.backends.core.local_state import load_whole, replicated_local_state
from polytrain.backends.core.sharding import shards
from polytrain.backends.core.strategy import TorchStrategy

__all__ = ["sharded_only"]

Hook = TypeVar("Hook", bound=Callable[..., Any])

#: What each hook does on one process holding the whole model (by hook name).
REPLICATED: dict[str, Callable[..., Any]] = {
    "prepare": TorchStrategy.prepare,
    "sample_distribution": TorchStrategy.sample_distribution,
    "full_state_dict": TorchStrategy.full_state_dict,
    "load_full_state_dict": TorchStrategy.load_full_state_dict,
    "sharded_state_dict": replicated_local_state,
    "load_sharded_state_dict": load_whole,
}


def sharded_only(hook: Hook) -> Hook:
    """Decorate a sharding strategy's hook: in local mode the replicated behaviour runs instead.

    The hook's last positional argument is the :class:`WorkerContext` (every hook
    in :data:`REPLICATED` takes it there).

    Raises:
        TypeError: at class definition, for a hook with no replicated behaviour here.
    """
    replicated = REPLICATED.get(hook.__name__)
    if replicated is None:
        raise TypeError(
            f"sharded_only knows no replicated behaviour for {hook.__name__!r}; it decorates "
            f"{sorted(REPLICATED)}."
        )

    @functools.wraps(hook)
    def run(self: Any, *args: Any) -> Any:
        if not shards(args[-1]):
            return replicated(self, *args)
        return hook(self, *args)

    return run  # type: ignore[return-value]
