"""Stopping a running ``train()`` call after an agreed batch (worker side).

The driver decides to stop a call early when a node of the group is draining
(:mod:`polytrain.runs.watch.drains`; the run loop settles the step with
:mod:`polytrain.runs.stop_at_step`). Every rank must stop after the
same batch, or one would wait forever in a collective the others never join. A
:class:`StopGate` per worker answers the driver's requests from the monitor
thread while the training thread runs the batch loop; :class:`GatedSteps` wraps
the call's batch iterator and asks the gate before every batch. Both sides hold
the gate's lock, so a rank either accepts a proposed stop before it starts the
batch after it, or refuses with where it is: never both.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from polytrain.launchers.worker import STOP_HANDLER, WORKER_STATE

logger = logging.getLogger(__name__)

#: Seconds between two checks while a rank waits at a proposed stop for the verdict.
_WAIT_S = 0.5


class StopGate:
    """One worker's stop state for its ``train()`` calls; called with the driver's requests.

    The driver numbers its calls; a request for a call that has not begun here yet
    is kept for it (the request can overtake the call), one for an older call is
    answered without effect.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._call: int | None = None
        self._running = False
        self._taken = 0
        self._target: int | None = None
        self._final = False
        self._early: dict[int, dict[str, Any]] = {}  # requests for a call not begun yet

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a request (see :func:`~polytrain.runs.stop_at_step.agree_on_stop`)."""
        call = int(request.get("call", -1))
        with self._cond:
            if self._call is None or call > self._call:
                self._early[call] = request
                return {"ok": True, "taken": 0}
            if call < self._call:
                return {"ok": True, "taken": 0, "stale": True}
            return self._answer(request)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        target = request.get("target")
        if request.get("cancel") or (target is None and request.get("final")):
            self._target, self._final = None, False
        elif target is not None:
            if self._taken > target:
                return {"ok": False, "taken": self._taken}
            if self._running:
                self._target, self._final = int(target), bool(request.get("final"))
        self._cond.notify_all()
        return {"ok": True, "taken": self._taken, "ended": not self._running}

    def begin(self, call: int) -> None:
        """The training thread starts call number ``call``."""
        with self._cond:
            self._call, self._running, self._taken = call, True, 0
            self._target, self._final = None, False
            early = self._early.pop(call, None)
            self._early.clear()
            if early is not None:
                self._answer(early)

    def end(self) -> None:
        """The call is over: later requests for it are answered with its final batch count."""
        with self._cond:
            self._running, self._target, self._final = False, None, False
            self._cond.notify_all()

    def claim(self) -> bool:
        """Before a batch: True to go on, False to stop here (waits while a proposed stop is open)."""
        with self._cond:
            while self._target is not None and self._taken >= self._target:
                if self._final:
                    return False
                self._cond.wait(_WAIT_S)
            self._taken += 1
            return True

    def unclaim(self) -> None:
        """The claimed batch did not come (the loader ended first)."""
        with self._cond:
            self._taken -= 1

    @property
    def stopped_early(self) -> bool:
        """Whether the driver stopped the running call (a final target reached)."""
        with self._cond:
            return self._final and self._target is not None and self._taken >= self._target


def gate() -> StopGate:
    """This worker's gate, created on first use and answering the monitor's stop requests."""
    found = WORKER_STATE.get(STOP_HANDLER)
    if not isinstance(found, StopGate):
        found = WORKER_STATE[STOP_HANDLER] = StopGate()
    return found


class GatedSteps:
    """A call's batch iterator that also stops where the driver's agreed stop falls.

    Wraps the :class:`~polytrain.trainer_api.data.cursor.StepIterator`; ``len()`` and
    :meth:`ends_epoch` are its own, except that a call stopped early never ends the
    epoch (``train(end_epoch=True)`` ends it only after the batches it asked for).
    """

    def __init__(self, inner: Any, stop_gate: StopGate) -> None:
        self.inner = inner
        self.gate = stop_gate
        self.stopped = False

    def __iter__(self) -> GatedSteps:
        return self

    def __next__(self) -> Any:
        if self.stopped or not self.gate.claim():
            self.stopped = True
            raise StopIteration
        try:
            return next(self.inner)
        except StopIteration:
            self.gate.unclaim()
            raise

    def __len__(self) -> int:
        return len(self.inner)

    def ends_epoch(self) -> bool:
        """Whether the epoch is over after the batches taken (see the wrapped iterator)."""
        limit = self.inner.num_steps
        if self.stopped and (limit is None or self.inner.taken < limit):
            return self.inner.cursor.finish_call()
        return self.inner.ends_epoch()
