"""Where a worker is in its training data, kept between ``train()`` calls (worker side).

``train(num_steps=N)`` continues the epoch where the previous call stopped, as
RaySGD did: the worker keeps its loader's iterator and the number of batches
taken from it. The epoch ends when the loader is exhausted; only then does the
sampler move to the next epoch (a new shuffle) and a new iterator start. The
driver is the source of truth for the position (epoch, batches consumed): it
sends it with every call, and a worker whose own position differs (a restarted
worker, a loaded checkpoint) starts that epoch's iterator again and skips the
batches already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from polytrain.trainer_api.data.loaders import set_sampler_epoch
from polytrain.trainer_api.profiling import PhaseTimer

_NOTHING = object()


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


class DataCursor:
    """This worker's live iterator over the training loader and its position in the epoch.

    Args:
        loader: the training loader (after the distributed sampler was added).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch: int | None = None
        self.position = 0
        self.exhausted = False
        self._iterator: Iterator | None = None
        self._pending: Any = _NOTHING  # a batch read ahead to find the end of an unsized loader

    def seek(self, epoch: int, position: int) -> None:
        """Be at batch ``position`` of ``epoch``: keep the live iterator if it is there already.

        Otherwise set the sampler's epoch, start a new iterator and skip
        ``position`` batches (they are loaded and dropped: the data position of a
        restarted worker or a loaded mid-epoch checkpoint).
        """
        if self._iterator is not None and (self.epoch, self.position) == (epoch, position):
            return
        set_sampler_epoch(self.loader, epoch)
        self._iterator = iter(self.loader)
        self.epoch, self.position, self.exhausted = epoch, 0, False
        self._pending = _NOTHING
        while self.position < position and self._next() is not _NOTHING:
            pass

    def reset(self) -> None:
        """Forget the live iterator: the next :meth:`seek` starts its epoch afresh."""
        self._iterator = None
        self._pending = _NOTHING

    def _next(self) -> Any:
        """The next batch, or ``_NOTHING`` at the end of the epoch (which marks it exhausted)."""
        if self._pending is not _NOTHING:
            batch, self._pending = self._pending, _NOTHING
        else:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.exhausted = True
                return _NOTHING
        self.position += 1
        return batch

    def remaining(self) -> int | None:
        """Batches left in this epoch, when the loader has a length."""
        length = _length(self.loader)
        return None if length is None else max(0, length - self.position)

    def take(
        self, num_steps: int | None, timer: PhaseTimer, end_epoch: bool = False
    ) -> StepIterator:
        """An iterator over the next ``num_steps`` batches (None: the rest of the epoch).

        ``end_epoch``: the epoch ends after these batches even if the loader has more.
        """
        return StepIterator(self, num_steps, timer, end_epoch)

    def finish_call(self) -> bool:
        """After a call: whether the epoch is over (the loader has no batch left).

        A sized loader is over when as many batches as its length were taken; an
        unsized one is asked for one more batch, kept for the next call.
        """
        if not self.exhausted:
            remaining = self.remaining()
            if remaining is not None:
                self.exhausted = remaining == 0
            elif self._pending is _NOTHING:
                try:
                    self._pending = next(self._iterator)
                except StopIteration:
                    self.exhausted = True
        return self.exhausted


class StepIterator:
    """At most ``num_steps`` batches from a :class:`DataCursor`; what ``train_epoch`` iterates.

    Stops early at the end of the epoch. ``len()`` is the number of batches it
    will yield when the loader has a length. Time spent waiting for a batch counts
    as the ``data`` phase of a profile.
    """

    def __init__(
        self,
        cursor: DataCursor,
        num_steps: int | None,
        timer: PhaseTimer,
        end_epoch: bool = False,
    ) -> None:
        self.cursor = cursor
        self.num_steps = num_steps
        self.timer = timer
        self.end_epoch = end_epoch
        self.taken = 0

    def __iter__(self) -> StepIterator:
        return self

    def __next__(self) -> Any:
        if self.num_steps is not None and self.taken >= self.num_steps:
            raise StopIteration
        with self.timer.phase("data"):
            batch = self.cursor._next()
        if batch is _NOTHING:
            raise StopIteration
        self.taken += 1
        return batch

    def ends_epoch(self) -> bool:
        """Whether the epoch is over after the batches taken so far (see :meth:`DataCursor.finish_call`)."""
        return self.cursor.finish_call() or self.end_epoch

    def __len__(self) -> int:
        remaining = self.cursor.remaining()
        if remaining is None:
            raise TypeError("the training loader has no length")
        if self.num_steps is None:
            return remaining
        return min(remaining, self.num_steps - self.taken)
