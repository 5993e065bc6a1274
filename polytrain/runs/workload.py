"""What a front end tells the run loop: what its workers run and how its state moves.

The run loop (:mod:`polytrain.runs.loop`) starts groups, runs calls, watches them
and carries out the policies' decisions the same way for every front end. A front
end (the creator API's trainers, the function API, the Lightning launcher,
``polytrain launch``) hands it a :class:`Workload`: how to set up a new group's
workers, how a restarted group gets the latest state back, and what a drain does
to a running call. Every hook but :meth:`Workload.setup_workers` has a default
that does nothing, so a front end implements only what it has.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from polytrain.backends.core.context import WorkerContext
from polytrain.errors import PolytrainError
from polytrain.launchers.base import WorkerGroup
from polytrain.runs.watch.drains import DrainEvent


@dataclass(frozen=True)
class DrainCheckpoint:
    """Where a call stopped for a drain, as the front end tells the run loop.

    Attributes:
        path: the committed checkpoint at the stop that the group continues from off
            the node; None: none (the call runs again, from the latest state).
        where: the position for the log line (``epoch 2, batch 40``, ``report 3``,
            ``the validate call``).
        resume: how a user continues past the drain limit (a sentence, for the error).
    """

    path: str | None
    where: str
    resume: str


class CallStoppedForDrain(PolytrainError):
    """Raised by :meth:`Workload.on_drain` to leave a running call that cannot stop at a step.

    The run loop counts the drain, moves the group off the node and runs the call
    again (Lightning's ``validate`` / ``test`` / ``predict``).
    """

    def __init__(self, event: DrainEvent, stop: DrainCheckpoint) -> None:
        super().__init__(event.describe())
        self.event = event
        self.stop = stop


class Workload(abc.ABC):
    """One front end's part of a run: the run loop calls these hooks, the front end implements them."""

    @abc.abstractmethod
    def setup_workers(self, group: WorkerGroup) -> None:
        """Driver: set up the workers of a new group, after the backend connected them."""

    @abc.abstractmethod
    def context(self, world_size: int) -> WorkerContext:
        """Driver: the context every worker of a new group of ``world_size`` starts from."""

    def worker_env(self) -> dict[str, str]:
        """Driver: environment variables for the workers, besides the backend's (default none)."""
        return {}

    def started(self) -> None:
        """Driver: a group started and is set up (the first one too): e.g. resume a run."""

    def before_restart(self, planned: bool) -> None:
        """Driver: a restart is about to tear the group down.

        ``planned``: the group is healthy (an elastic group growing back): background
        writes may finish first; False: it failed or was torn down already.
        """

    def restore(self) -> None:
        """Driver: a restarted group is set up: bring the latest recovery point into it."""

    def restart_source(self) -> str | None:
        """Driver: a lost worker restarts the group: where does the new group resume from?

        Called once per such restart, before it; the answer names the state for the
        log line (None: not said). A front end whose calls carry their resume point
        (Lightning's ``ckpt_path``) chooses it here.
        """
        return None

    def after_failed_call(self, error: BaseException) -> None:
        """Driver: a call failed (or was interrupted); the group is still up, about to go.

        The last moment to read the workers' monitor channel (a script's last lines).
        """

    def pollers(self) -> list[Callable[[], None]]:
        """Driver: more functions the loop calls while a call runs (about every 0.25 s)."""
        return []

    #: Kill a group whose call failed instead of the backend's clean-up and the warm pool
    #: (a script's child processes may hold a collective).
    kill_failed_groups: bool = False

    def on_drain(self, event: DrainEvent, new: bool) -> None:
        """Driver: a drain of the group's nodes is pending (called at every poll until acted on).

        ``new``: this poll saw it first. The front end tells the running call (stop at
        an agreed step, announce it to the loop), or raises :class:`CallStoppedForDrain`
        to leave the call at once. Default: nothing (the call runs to its end and the
        front end moves off the node at the next boundary).
        """
