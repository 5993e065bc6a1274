"""The Ray implementation of the worker-group contract: actors in a placement group.

:class:`RayWorkerGroup` implements :class:`polytrain.launchers.base.WorkerGroup`.
The name ``WorkerGroup`` in this module stays an alias of it, and
:func:`ensure_ray` is re-exported from :mod:`polytrain.launchers.connect`, so
imports written against the older layout keep working.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polytrain.errors import ConfigError, WorkerDiedError, WorkerError
from polytrain.launchers import autoscaler, base, pool
from polytrain.launchers.connect import ensure_ray
from polytrain.launchers.placement import (
    check_feasible,
    classify_failure,
    not_placed_error,
    trial_placement_group,
    wait_until_placed,
)
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
        start_timeout_s: fail if the workers cannot be placed within this time; None:
            30 s, or minutes when an autoscaler may add nodes for them.
        env_vars: environment every worker starts with.
        preload: modules new workers import in the background as soon as they start
            (torch, the backend's libraries), while the driver goes on setting up;
            None: the pool settings' ``preload``.

    Workers come from the warm pool (:mod:`polytrain.launchers.pool`) when it holds
    a group of this shape (:attr:`reused`) and go back to it on a healthy
    :meth:`shutdown`. :attr:`timings`: wall-clock marks of :meth:`start`.

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
        start_timeout_s: float | None = None,
        env_vars: dict[str, str] | None = None,
        preload: Sequence[str] | None = None,
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
        self.preload = tuple(pool.get_settings().preload if preload is None else preload)
        self.actors: list[Any] = []
        self.metadata: list[WorkerMetadata] = []
        self.rank_infos: list[RankInfo] = []
        self.device_indices: list[int] = []
        self._autoscaling: autoscaler.ClusterShape | None = None
        self._placement_group = None
        self._owns_placement_group = True
        self.reused = False
        self.timings: dict[str, float] = {}
        self._pool_key: pool.PoolKey | None = None
        self._unhealthy = False  # a call failed or was abandoned: never pool these actors
        self._waiting = 0  # get() calls in progress: shutting down now abandons them

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Take a warm group from the pool, or place and start new actors; learn where each runs.

        Inside a Tune trial's placement group (see :func:`trial_placement_group`) the
        workers take its last n bundles instead of a new group's.

        Raises:
            InsufficientResourcesError: the workers cannot be placed within ``start_timeout_s``.
            WorkerDiedError: an actor died (or never answered) while starting.
        """
        self.timings = {"start": time.time()}
        self._unhealthy = False
        self.reused = self._start_warm()
        if not self.reused:
            self._start_cold()
        self.rank_infos = compute_ranks([m.node_id for m in self.metadata])
        self._assign_devices()
        self.timings["ready"] = time.time()

    def _start_cold(self) -> None:
        first_bundle = self._reserve_bundles()
        # Actors are created at once: Ray starts them as soon as the bundles are placed.
        actors = self._start_actors(first_bundle)
        self._wait_until_placed()
        self.timings["placed"] = time.time()
        metadata = self._read_metadata(actors)
        self.timings["actors_ready"] = time.time()
        # Co-located workers get contiguous ranks: local ranks follow from world ranks.
        order = order_by_node([m.node_id for m in metadata])
        self.actors = [actors[i] for i in order]
        self.metadata = [metadata[i] for i in order]

    def _start_warm(self) -> bool:
        """Adopt a pooled group of this shape; False when there is none (or it is unfit)."""
        if not pool.is_enabled():
            return False
        self._pool_key = pool.PoolKey.of(self, trial_placement_group(self.num_workers))
        taken = pool.POOL.take_ready(self._pool_key, self.env_vars)
        if taken is None:
            return False
        idle, self.metadata = taken
        self.actors = list(idle.actors)
        self._placement_group = idle.placement_group
        self._owns_placement_group = idle.owns_placement_group
        self.timings["placed"] = self.timings["actors_ready"] = time.time()
        return True

    def _requested(self) -> str:
        return f"{self.num_workers} worker(s) x {self.bundle} ({self.placement_strategy})"

    def _reserve_bundles(self) -> int:
        """Set :attr:`_placement_group` (the trial's own, or a new one); return the first bundle index."""
        current = trial_placement_group(self.num_workers)
        self._pool_key = pool.PoolKey.of(self, current)
        if current is not None:
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
            check_feasible(self.bundle, self._requested())
        needed = {k: v * self.num_workers for k, v in self.bundle.items()}
        pool.POOL.make_room(needed, ray.available_resources())  # idle workers make way
        self._placement_group = placement_group(
            [dict(self.bundle) for _ in range(self.num_workers)],
            strategy=self.placement_strategy,
        )
        self._owns_placement_group = True
        return 0

    def _wait_until_placed(self) -> None:
        placed = wait_until_placed(
            self._placement_group.ready(),
            self.start_timeout_s,
            self.bundle,
            self.num_workers,
            self._autoscaling,
        )
        if placed:
            return
        used = autoscaler.start_timeout(self.start_timeout_s, self._autoscaling)
        error = not_placed_error(self._requested(), used)
        self._unhealthy = True
        self.shutdown()
        raise error

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
            ).remote(self.env_vars, niceness, self.preload)
            for i in range(self.num_workers)
        ]
        return self.actors

    def _read_metadata(self, actors: list[Any]) -> list[WorkerMetadata]:
        try:
            return ray.get(
                [a.metadata.remote() for a in actors],
                timeout=autoscaler.start_timeout(self.start_timeout_s, self._autoscaling) + 60,
            )
        except (RayActorError, GetTimeoutError) as exc:
            self._unhealthy = True
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

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release the workers: back to the warm pool if healthy, else stopped. Safe to call twice.

        Workers whose call raised, died, hung or was interrupted are stopped (actors
        killed, placement group removed), as are all when the pool is off or full.
        """
        actors, self.actors = self.actors, []
        group, self._placement_group = self._placement_group, None
        if actors and self._release_to_pool(actors, group):
            return
        pool.stop_actors(actors, group if self._owns_placement_group else None)

    def terminate(self) -> None:
        """Stop every worker now, never keeping them warm (e.g. on Ctrl+C)."""
        self._unhealthy = True
        self.shutdown()

    def _release_to_pool(self, actors: list[Any], group: Any) -> bool:
        if self._unhealthy or self._waiting or group is None or not pool.is_enabled():
            return False
        for actor in actors:
            actor.reset.remote()  # Ray runs it before any later call on the actor (reuse)
        idle = pool.IdleGroup(
            self._pool_key, actors, list(self.metadata), group, self._owns_placement_group
        )
        return pool.POOL.put(idle)


#: The name this class had before the contract was declared; kept for existing imports.
WorkerGroup = RayWorkerGroup
