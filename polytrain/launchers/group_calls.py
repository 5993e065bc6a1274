"""Calls into a running worker group: run functions on its workers, wait, monitor.

:class:`GroupCalls` is the half of :class:`~polytrain.launchers.worker_group.RayWorkerGroup`
that talks to started actors; the group itself places, starts, pools and stops them.
It uses the group's ``actors`` and ``metadata`` (rank order) and marks the group
unfit for the warm pool (``_unhealthy``) when a call fails or is abandoned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from polytrain.errors import WorkerError
from polytrain.launchers.placement import classify_failure

logger = logging.getLogger(__name__)

#: The actors' concurrency group for monitor calls (answered while training runs).
MONITOR_GROUP = "monitor"


class GroupCalls:
    """Run functions on a group's workers and wait for them, failing fast (a mixin)."""

    actors: list[Any]
    metadata: list[Any]
    _unhealthy: bool
    _waiting: int

    def execute_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; return the object refs."""
        return [a.execute.remote(fn, *args, **kwargs) for a in self.actors]

    def execute_single_async(
        self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Start ``fn`` on the worker of world rank ``rank``; return its object ref."""
        return self.actors[rank].execute.remote(fn, *args, **kwargs)

    def execute_best_effort(self, fn: Callable[..., Any], timeout_s: float = 5.0) -> None:
        """Run ``fn`` on every worker, waiting at most ``timeout_s``; failures are ignored.

        For clean-up on shutdown: a dead worker, or one stuck in a collective with a
        dead peer, must not hold the driver up (the group kills them afterwards).
        """
        if not self.actors:
            return
        try:
            refs = self.execute_async(fn)
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            self._unhealthy |= bool(pending)  # stuck workers: never pool them
            ray.get(done)
        except Exception:  # noqa: BLE001 - best effort by definition
            self._unhealthy = True
            logger.debug("best-effort call %s failed", getattr(fn, "__name__", fn), exc_info=True)

    def share(self, value: Any) -> Any:
        """Put ``value`` into Ray's object store once; every worker reads the same copy."""
        return ray.put(value)

    def monitor(self, method: str, timeout_s: float = 10.0) -> list[Any]:
        """Call a monitor method (``progress``, ``stacks``, ``ping``) on every worker.

        Answered from the actors' monitor threads, so it works while training runs or
        is stuck. A worker that does not answer in time yields its exception instead.
        """
        refs = [self.monitor_single_async(rank, method) for rank in range(len(self.actors))]
        results: list[Any] = []
        deadline = time.monotonic() + timeout_s
        for ref in refs:
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                results.append(exc)
        return results

    def monitor_single_async(self, rank: int, method: str, *args: Any) -> Any:
        """Start a monitor method on one worker (with ``args``); return its object ref."""
        actor = self.actors[rank]
        return getattr(actor, method).options(concurrency_group=MONITOR_GROUP).remote(*args)

    def poll(self, ref: Any) -> tuple[bool, Any]:
        """``(done, value)`` of an object ref without waiting; a failed call's value is ``None``."""
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return False, None
        try:
            return True, ray.get(ref)
        except Exception:  # noqa: BLE001 - a dead worker is reported by the caller's main wait
            return True, None

    def get(
        self,
        refs: Sequence[Any],
        ranks: Sequence[int] | None = None,
        on_poll: Callable[[], None] | None = None,
        poll_interval_s: float = 0.5,
    ) -> list[Any]:
        """Wait for ``refs`` and return their values, failing fast on the first error.

        The first worker to fail is reported with its rank and remote traceback at
        once, without waiting for the others (which may be blocked in a collective
        that can no longer complete). ``on_poll`` is called every ``poll_interval_s``
        while waiting; an exception it raises aborts the wait.
        """
        self._waiting += 1
        try:
            return self._get(refs, ranks, on_poll, poll_interval_s)
        except BaseException:
            # A failed, interrupted or abandoned call: these workers are not fit for reuse.
            self._unhealthy = True
            raise
        finally:
            self._waiting -= 1

    def _get(
        self,
        refs: Sequence[Any],
        ranks: Sequence[int] | None,
        on_poll: Callable[[], None] | None,
        poll_interval_s: float,
    ) -> list[Any]:
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        pending = list(refs)
        while pending:
            timeout = poll_interval_s if on_poll is not None else None
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            for ref in ready:
                try:
                    ray.get(ref)
                except (RayTaskError, RayActorError) as exc:
                    raise self._classify_failure(exc, rank_of[ref]) from None
            if pending and on_poll is not None:
                on_poll()
        return ray.get(list(refs))

    def _classify_failure(self, exc: BaseException, rank: int) -> WorkerError:
        """Turn a failed call into a WorkerError, blaming a dead worker if there is one."""
        return classify_failure(exc, rank, self.metadata, lambda: self.monitor("ping", 5.0))
