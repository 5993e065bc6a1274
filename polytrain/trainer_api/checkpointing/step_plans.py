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
``every_n_steps`` batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["StepCheckpointPlan", "combine_call_stats", "train_in_chunks"]

#: Batches of the first piece when only ``every_s`` is set: enough to measure the step rate.
PROBE_STEPS = 8

#: Summed over the pieces of a call; the rest are sample-weighted means (or the last value).
_SUMMED = ("num_samples", "num_tokens", "num_steps", "epoch_time_s")
_LAST = ("num_restarts", "num_workers", "epoch")
_MAXED = ("peak_memory_mb",)


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


def combine_call_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One call's metrics from those of its pieces (each already reduced over the workers).

    Counts and times add up, ``samples_per_s`` is recomputed, peaks take the
    maximum, other numbers are averaged weighted by samples, the rest (``epoch``,
    ``num_restarts``, ``checkpoint_path``) come from the piece that has them last.
    """
    if len(parts) == 1:
        return parts[0]
    weights = [float(p.get("num_samples", 0) or 0) for p in parts]
    total = sum(weights) or 1.0
    combined: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in combined or key in _LAST or not isinstance(value, (int, float)):
                combined[key] = value
    for key in combined:
        values = [p[key] for p in parts if isinstance(p.get(key), (int, float))]
        if key in _SUMMED:
            combined[key] = sum(values)
        elif key in _MAXED:
            combined[key] = max(values)
        elif key in _LAST or isinstance(combined[key], bool) or len(values) != len(parts):
            continue
        elif isinstance(combined[key], float):
            combined[key] = sum(w * p[key] for w, p in zip(weights, parts, strict=True)) / total
    combined["epoch"] = parts[0].get("epoch")  # the epoch the call's batches belonged to
    if combined.get("epoch_time_s"):
        combined["samples_per_s"] = combined.get("num_samples", 0) / combined["epoch_time_s"]
        if "num_tokens" in combined:
            combined["tokens_per_s"] = combined["num_tokens"] / combined["epoch_time_s"]
    profiles = [p["profile"] for p in parts if isinstance(p.get("profile"), dict)]
    if profiles:
        combined["profile"] = {k: sum(float(p.get(k, 0.0)) for p in profiles) for k in profiles[-1]}
    return combined


def train_in_chunks(
    plan: StepCheckpointPlan,
    train_once: Callable[[int, bool, bool], tuple[dict[str, Any], list[Any], bool, bool]],
    num_steps: int | None,
    end_epoch: bool,
    stop: Callable[[], bool] | None = None,
) -> tuple[dict[str, Any], list[list[Any]]]:
    """Run one ``train(num_steps)`` call as pieces that end where a checkpoint is due.

    Args:
        plan: the trainer's plan (it lives as long as the trainer).
        train_once: ``(batches, end_epoch, checkpoint_due) -> (stats, per-worker results,
            wrote_checkpoint, epoch_done)``: one worker call.
        num_steps: the call's batches; None: the rest of the epoch.
        end_epoch: the call ends the epoch after its batches (only the last piece does).
        stop: asked after every piece; True ends the call there (a termination signal).

    Returns:
        The combined stats and every piece's per-worker results.
    """
    parts, raws, left = [], [], num_steps
    while True:
        piece, due = plan.next_piece(left)
        last = left is not None and piece >= left
        start = time.monotonic()
        stats, results, wrote, epoch_done = train_once(piece, end_epoch and last, due)
        steps = int(stats.get("num_steps", 0) or 0)
        plan.record(steps, time.monotonic() - start, wrote)
        parts.append(stats)
        raws.append(results)
        if left is not None:
            left -= steps
        stopped = stop is not None and stop()
        if stopped or epoch_done or steps < piece or (left is not None and left <= 0):
            return combine_call_stats(parts), raws
