"""The collectives of the training loop, through the run's report board (no process group needed)."""

from __future__ import annotations

import pickle
from typing import TypeVar

from polytrain.errors import ConfigError
from polytrain.train import session as train_session

T = TypeVar("T")

#: The largest pickled payload :func:`broadcast_from_rank_zero` takes. It travels
#: through the driver; larger data belongs in a checkpoint or the object store.
_MAX_BROADCAST_SIZE_BYTES = 1024 * 1024


def broadcast_from_rank_zero(data: T) -> T:
    """Rank 0's ``data`` on every rank; every rank must call it (it is a barrier too).

    Args:
        data: a small picklable value (up to 1 MiB pickled); only rank 0's counts.

    Returns:
        Rank 0's ``data``.

    Raises:
        ConfigError: the pickled data is larger than the limit (a ``ValueError``).
        TypeError, pickle.PicklingError: the data cannot be pickled.
        SessionMisuseError: called outside a training loop.
    """
    payload = pickle.dumps(data)
    if len(payload) > _MAX_BROADCAST_SIZE_BYTES:
        raise ConfigError(
            f"broadcast_from_rank_zero: the data is {len(payload)} bytes pickled, more than the "
            f"{_MAX_BROADCAST_SIZE_BYTES} bytes it takes (it travels through the driver). Put "
            f"large data in a checkpoint or ray.put() it and broadcast the reference."
        )
    session = train_session.current("collective.broadcast_from_rank_zero")
    rank = session.context.world_rank
    return pickle.loads(train_session.collective(session, payload if rank == 0 else None))


def barrier() -> None:
    """Wait until every rank has called ``barrier()``.

    Raises:
        SessionMisuseError: called outside a training loop.
    """
    train_session.collective(train_session.current("collective.barrier"), None)
