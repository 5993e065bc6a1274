"""Mid-epoch checkpoints (``CheckpointConfig(every_n_steps=..., every_s=...)``), driver side.

A ``train()`` call is cut into worker calls that end where a checkpoint is due;
calls already continue the epoch where the previous one stopped (see
:mod:`polytrain.trainer_api.data.cursor`), so the pieces train exactly the batches
one call would have. The worker call that ends at a due point writes a
checkpoint directory named for its position (``checkpoint_000003.00000040``:
40 batches into the 4th epoch) with the position in its meta; a restart
restores it and the workers' cursors skip the batches already trained, so a
lost worker costs at most the steps since that checkpoint.

Each piece is one more driver round trip (a few milliseconds), paid once per
``every_n_steps`` batches. The plan is arithmetic only: the trainer's ``train()``
asks it for each piece's size and tells it what the piece trained; the pieces'
metrics are combined by :func:`polytrain.trainer_api.results.combine_call_stats`.
The walk from the option to disk: ``CheckpointConfig.every_n_steps`` ->
:class:`StepCheckpointPlan` (here) -> ``TorchTrainer.train`` (a worker call per
piece, the due one with a
:class:`~polytrain.checkpoint.directory.SaveRequest`) -> the worker's
``train_epoch`` -> :mod:`polytrain.trainer_api.checkpointing.worker_writer` ->
:mod:`polytrain.checkpoint.directory` (the files, the commit marker last).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PROBE_STEPS", "StepCheckpointPlan"]

#: Batches of the first piece when only ``every_s`` is set: enough to measure the step rate.
PROBE_STEPS = 8


class StepCheckpointPlan:
    """Where the next mid-epoch checkpoint falls, counted in batches and seconds.

    Args:
        every_n_steps: a checkpoint every this many batches (None: not by steps).
        every_s: a checkpoint once this many seconds have passed since the last one
            (None: not by time). The time is turned into batches with the step rate
            measured on the previous piece, so it is met to within a piece.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        every_n_steps: int | None,
        every_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.every_s = every_s
        self._clock = clock
        self.steps_since = 0
        self._last = clock()
        self._rate: float | None = None  # batches per second, measured

    @property
    def active(self) -> bool:
        """True when mid-epoch checkpoints are asked for."""
        return bool(self.every_n_steps or self.every_s)

    def next_piece(self, left: int | None) -> tuple[int, bool]:
        """``(batches, due)``: the next worker call's size, and whether a checkpoint ends it.

        Args:
            left: batches the ``train()`` call still has to train; None: the rest of the epoch.
        """
        room: int | None = None
        if self.every_n_steps:
            room = max(1, self.every_n_steps - self.steps_since)
        if self.every_s:
            if self._rate is None:
                by_time = PROBE_STEPS
            else:
                remaining_s = self.every_s - (self._clock() - self._last)
                by_time = max(1, round(remaining_s * self._rate))
            room = by_time if room is None else min(room, by_time)
        assert room is not None, "next_piece() needs every_n_steps or every_s"
        if left is not None and left < room:
            return left, False
        due = (
            self.every_n_steps is not None and self.steps_since + room >= self.every_n_steps
        ) or (self.every_s is not None and self._rate is not None)
        return room, due

    def record(self, steps: int, seconds: float, checkpointed: bool) -> None:
        """After a piece: its batches and time; whether a checkpoint (mid or epoch end) ended it."""
        if steps > 0 and seconds > 0:
            self._rate = steps / seconds
        if checkpointed:
            self.steps_since, self._last = 0, self._clock()
        else:
            self.steps_since += steps
