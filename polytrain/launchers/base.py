"""The worker-group contract: start processes, run functions in them, stop them.

Two implementations: :class:`~polytrain.launchers.worker_group.RayWorkerGroup`
(Ray actors in a placement group) and
:class:`~polytrain.launchers.local.LocalWorkerGroup` (the driver process itself,
``num_workers=0``). Trainers, backends' rendezvous and the Lightning strategies
use only what is declared here. ``launchers/`` knows nothing of trainers or
backends.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from polytrain.launchers.ranks import RankInfo, WorkerMetadata


class WorkerGroup(abc.ABC):
    """A group of worker processes, addressed by world rank.

    After :meth:`start`, :attr:`metadata`, :attr:`rank_infos` and
    :attr:`device_indices` are in rank order (co-located workers contiguous).

    Attributes:
        env_vars: the environment every worker starts with.
        metadata: where each worker runs (node, IP, pid, GPUs).
        rank_infos: world, local and node ranks of each worker.
        device_indices: each worker's CUDA device index among the devices it sees (-1: CPU).
    """

    env_vars: dict[str, str]
    metadata: list[WorkerMetadata]
    rank_infos: list[RankInfo]
    device_indices: list[int]

    @abc.abstractmethod
    def start(self) -> None:
        """Start the workers and learn where each runs."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of running workers."""

    @abc.abstractmethod
    def execute_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; return one handle per rank for :meth:`get`."""

    @abc.abstractmethod
    def execute_single_async(
        self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Start ``fn`` on the worker of world rank ``rank``; return its handle."""

    @abc.abstractmethod
    def get(
        self,
        refs: Sequence[Any],
        ranks: Sequence[int] | None = None,
        on_poll: Callable[[], None] | None = None,
        poll_interval_s: float = 0.5,
    ) -> list[Any]:
        """Wait for handles and return their values, failing fast on the first error.

        A failure raises :class:`~polytrain.errors.WorkerError` (or
        :class:`~polytrain.errors.WorkerDiedError` for a lost process) naming the
        rank. ``on_poll`` is called every ``poll_interval_s`` while waiting; an
        exception it raises aborts the wait.
        """

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every worker and return the results in rank order."""
        return self.get(self.execute_async(fn, *args, **kwargs))

    def execute_single(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the worker of world rank ``rank`` and return its result."""
        return self.get([self.execute_single_async(rank, fn, *args, **kwargs)], ranks=[rank])[0]

    @abc.abstractmethod
    def execute_best_effort(self, fn: Callable[..., Any], timeout_s: float = 5.0) -> None:
        """Run ``fn`` on every worker, waiting at most ``timeout_s``; failures are ignored.

        For clean-up: a dead worker, or one stuck in a collective with a dead peer,
        must not hold the driver up.
        """

    def share(self, value: Any) -> Any:
        """A handle to ``value`` that every worker can receive as an argument of a call.

        For large values sent to every worker (a checkpoint): the Ray group puts it
        into the object store once instead of pickling it into every call. This
        default hands the value itself.
        """
        return value

    @abc.abstractmethod
    def monitor(self, method: str, timeout_s: float = 10.0) -> list[Any]:
        """Call a monitor method (``progress``, ``stacks``, ``ping``) on every worker.

        Answered while training runs or is stuck; a worker that does not answer in
        time yields its exception instead of a value.
        """

    @abc.abstractmethod
    def monitor_single_async(self, rank: int, method: str, *args: Any) -> Any:
        """Start a monitor method on one worker (with ``args``); return its handle."""

    @abc.abstractmethod
    def poll(self, ref: Any) -> tuple[bool, Any]:
        """``(done, value)`` of a monitor handle without waiting; a failed call's value is ``None``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the workers. Safe to call twice.

        A Ray group whose workers are healthy hands them to the warm pool
        (:mod:`polytrain.launchers.pool.warm_pool`), which keeps them ready for the next group
        of the same shape and stops them after its idle timeout; otherwise, and
        whenever the pool is off, the workers are stopped and their resources freed.
        """

    def terminate(self) -> None:
        """Stop every worker now and free its resources, never keeping them warm (Ctrl+C)."""
        self.shutdown()
