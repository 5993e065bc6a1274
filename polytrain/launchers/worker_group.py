"""The Ray implementation of the worker-group contract: actors in a placement group.

:class:`RayWorkerGroup` implements :class:`polytrain.launchers.base.WorkerGroup`.
The name ``WorkerGroup`` in this module stays an alias of it, and
:func:`ensure_ray` is re-exported from :mod:`polytrain.launchers.connect`, so
imports written against the older layout keep working.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polytrain.errors import (
    ConfigError,
    InsufficientResourcesError,
    WorkerDiedError,
    WorkerError,
    worker_error_like,
)
from polytrain.launchers import autoscaler, base
from polytrain.launchers.connect import ensure_ray, format_resources
from polytrain.launchers.ranks import (
    RankInfo,
    WorkerMetadata,
    compute_ranks,
    order_by_node,
    shared_visible_devices,
)
from polytrain.launchers.scaling import PLACEMENT_STRATEGIES
from polytrain.launchers.worker import Worker

__all__ = ["PLACEMENT_STRATEGIES", "RayWorkerGroup", "WorkerGroup", "ensure_ray"]

logger = logging.getLogger(__name__)

_MONITOR = "monitor"


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _describe_failure(exc: BaseException, rank: int, meta: WorkerMetadata | None) -> WorkerError:
    where = f" (pid {meta.pid} on {meta.node_ip})" if meta else ""
    if isinstance(exc, RayActorError):
        return WorkerDiedError(
            f"Worker rank {rank}{where} died: {exc}", rank=rank, remote_traceback=str(exc)
        )
    if isinstance(exc, RayTaskError):
        cause = exc.as_instanceof_cause()
        remote_tb = _ANSI_ESCAPE.sub("", str(exc))
        # Also an instance of the user's exception class, so `except ValueError` still works.
        error = worker_error_like(
            exc.cause,
            f"Worker rank {rank}{where} raised {exc.cause.__class__.__name__}: {exc.cause}\n\n"
            f"Remote traceback (rank {rank}):\n{remote_tb}",
            rank=rank,
            remote_traceback=remote_tb,
        )
        error.__cause__ = cause
        return error
    return WorkerError(f"Worker rank {rank}{where} failed: {exc!r}", rank=rank)


class RayWorkerGroup(base.WorkerGroup):
    """A group of :class:`Worker` actors placed together in one placement group.

    World rank ``i`` is the ``i``-th worker after co-located workers were made
    contiguous; :attr:`rank_infos` and :attr:`metadata` follow that order.

    Args:
        num_workers: how many actors to start (>= 1).
        num_cpus_per_worker: CPUs reserved for each actor.
        num_gpus_per_worker: GPUs reserved for each actor (0 or 1 for training).
        resources_per_worker: extra custom resources per actor.
        placement_strategy: one of "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD".
        start_timeout_s: fail if the workers cannot be placed within this time.
        env_vars: environment every worker starts with.

    Raises:
        ConfigError: an unknown ``placement_strategy``.
    """

    def __init__(
        self,
        num_workers: int,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        start_timeout_s: float = 30.0,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"placement_strategy={placement_strategy!r} is not supported. Must be one of "
                f"{PLACEMENT_STRATEGIES}."
            )
        self.num_workers = num_workers
        self.bundle = {"CPU": float(num_cpus_per_worker)}
        if num_gpus_per_worker:
            self.bundle["GPU"] = float(num_gpus_per_worker)
        self.bundle.update(resources_per_worker or {})
        self.placement_strategy = placement_strategy
        self.start_timeout_s = start_timeout_s
        self.env_vars = dict(env_vars or {})
        self.actors: list[Any] = []
        self.metadata: list[WorkerMetadata] = []
        self.rank_infos: list[RankInfo] = []
        self.device_indices: list[int] = []
        self._autoscaling: autoscaler.ClusterShape | None = None
        self._placement_group = None
        self._owns_placement_group = True

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Place and start the actors, then learn where each runs.

        Inside a placement group with a bundle per worker (a Ray Tune trial with the
        trainable's PlacementGroupFactory), the workers go into the last n bundles of
        that group instead of a new one, which could never be placed while the trial
        holds the resources.

        Raises:
            InsufficientResourcesError: the workers cannot be placed within ``start_timeout_s``.
            WorkerDiedError: an actor died (or never answered) while starting.
        """
        first_bundle = self._reserve_bundles()
        self._wait_until_placed()
        actors = self._start_actors(first_bundle)
        metadata = self._read_metadata(actors)
        # Co-located workers get contiguous ranks: local ranks follow from world ranks.
        order = order_by_node([m.node_id for m in metadata])
        self.actors = [actors[i] for i in order]
        self.metadata = [metadata[i] for i in order]
        self.rank_infos = compute_ranks([m.node_id for m in self.metadata])
        self._assign_devices()

    def _requested(self) -> str:
        return f"{self.num_workers} worker(s) x {self.bundle} ({self.placement_strategy})"

    def _check_feasible(self) -> None:
        total = ray.cluster_resources()
        for resource, amount in self.bundle.items():
            if total.get(resource, 0.0) < amount:
                raise InsufficientResourcesError(
                    f"Requested {self._requested()}, but the Ray cluster has "
                    f"{total.get(resource, 0.0):g} {resource} in total, so no worker can "
                    f"ever be placed. Cluster resources: {format_resources(total)}. "
                    + (
                        "Set use_gpu=False or add GPU nodes."
                        if resource == "GPU"
                        else "Lower the per-worker resources or add nodes."
                    )
                )

    def _reserve_bundles(self) -> int:
        """Set :attr:`_placement_group` (the trial's own, or a new one); return the first bundle index."""
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= self.num_workers:
            # The workers take the last n bundles: Tune puts the trainable's bundle first,
            # and drops it when the trainable reserves nothing.
            self._placement_group, self._owns_placement_group = current, False
            return len(current.bundle_specs) - self.num_workers
        # Judged against what the cluster can become (the autoscaler's node types) where
        # an autoscaler is visible; against the live nodes otherwise.
        self._autoscaling = autoscaler.judge_request(
            self.bundle, self.num_workers, self.placement_strategy, self._requested()
        )
        if self._autoscaling is None:
            self._check_feasible()
        self._placement_group = placement_group(
            [dict(self.bundle) for _ in range(self.num_workers)],
            strategy=self.placement_strategy,
        )
        self._owns_placement_group = True
        return 0

    def _wait_until_placed(self) -> None:
        timeout = autoscaler.start_timeout(self.start_timeout_s, self._autoscaling)
        if self._autoscaling is None:
            placed = bool(ray.wait([self._placement_group.ready()], timeout=timeout)[0])
        else:
            placed = autoscaler.wait_for_nodes(
                self._placement_group.ready(),
                timeout,
                self.bundle,
                self.num_workers,
                self._autoscaling,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
        if placed:
            return
        available = ray.available_resources()
        total = ray.cluster_resources()
        self.shutdown()
        raise InsufficientResourcesError(
            f"Could not place {self._requested()} within start_timeout_s="
            f"{self.start_timeout_s:g}s. Available now: {format_resources(available)}; cluster total: "
            f"{format_resources(total)}. Lower num_workers or the per-worker resources, free the "
            f"cluster, add nodes, or raise start_timeout_s."
        )

    def _start_actors(self, first_bundle: int) -> list[Any]:
        remote_cls = ray.remote(concurrency_groups={_MONITOR: 2})(Worker)
        # Workers take the driver's CPU priority (Ray's default worker niceness is 15).
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        self.actors = [
            remote_cls.options(
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group,
                    placement_group_bundle_index=first_bundle + i,
                ),
                max_restarts=0,
            ).remote(self.env_vars, niceness)
            for i in range(self.num_workers)
        ]
        return self.actors

    def _read_metadata(self, actors: list[Any]) -> list[WorkerMetadata]:
        try:
            return ray.get([a.metadata.remote() for a in actors], timeout=self.start_timeout_s + 60)
        except (RayActorError, GetTimeoutError) as exc:
            self.shutdown()
            raise WorkerDiedError(
                f"Workers failed to start: {exc}", rank=-1, remote_traceback=str(exc)
            ) from exc

    def _assign_devices(self) -> None:
        """Let co-located GPU workers see each other's devices (needed by nccl's P2P)."""
        if not self.bundle.get("GPU"):
            self.device_indices = [-1] * self.num_workers
            return
        visible = shared_visible_devices(self.metadata)
        self.get(
            [
                actor.set_env_vars.remote({"CUDA_VISIBLE_DEVICES": devices})
                for actor, (devices, _) in zip(self.actors, visible, strict=True)
            ]
        )
        self.device_indices = [index for _, index in visible]

    # -------------------------------------------------------------- execute
    def __len__(self) -> int:
        return len(self.actors)

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
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - best effort by definition
            logger.debug("best-effort call %s failed", getattr(fn, "__name__", fn), exc_info=True)

    def share(self, value: Any) -> Any:
        """Put ``value`` into Ray's object store once; every worker reads the same copy."""
        return ray.put(value)

    # -------------------------------------------------------------- monitor
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

    def monitor_single_async(self, rank: int, method: str) -> Any:
        """Start a monitor method on one worker; return its object ref."""
        actor = self.actors[rank]
        return getattr(actor, method).options(concurrency_group=_MONITOR).remote()

    def poll(self, ref: Any) -> tuple[bool, Any]:
        """``(done, value)`` of an object ref without waiting; a failed call's value is ``None``."""
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return False, None
        try:
            return True, ray.get(ref)
        except Exception:  # noqa: BLE001 - a dead worker is reported by the caller's main wait
            return True, None

    # ------------------------------------------------------------------ get
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
        """Turn a failed call into a WorkerError, blaming a dead worker if there is one.

        When a worker process dies, its peers usually fail first with a collective
        error ("connection closed by peer"); that is a symptom. A quick liveness
        probe finds the worker that really died, so the failure is reported (and
        retried) as a lost worker rather than as an application error.
        """
        error = _describe_failure(exc, rank, self._meta(rank))
        if isinstance(error, WorkerDiedError):
            return error
        for other, answer in enumerate(self.monitor("ping", timeout_s=5.0)):
            if isinstance(answer, RayActorError):
                died = _describe_failure(answer, other, self._meta(other))
                died.args = (
                    f"{died.args[0]}\n(rank {rank} then failed with: {error.args[0][:2000]})",
                )
                return died
        return error

    def _meta(self, rank: int) -> WorkerMetadata | None:
        return self.metadata[rank] if 0 <= rank < len(self.metadata) else None

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Kill every actor and release the placement group. Safe to call twice."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.actors = []
        if self._placement_group is not None and self._owns_placement_group:
            try:
                remove_placement_group(self._placement_group)
            except Exception:  # noqa: BLE001
                pass
        self._placement_group = None


#: The name this class had before the contract was declared; kept for existing imports.
WorkerGroup = RayWorkerGroup
