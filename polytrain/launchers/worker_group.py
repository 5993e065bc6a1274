"""The Ray implementation of the worker-group contract: actors in a placement group.

:class:`RayWorkerGroup` implements :class:`polytrain.launchers.base.WorkerGroup`.
The name ``WorkerGroup`` in this module stays an alias of it, and
:func:`ensure_ray` is re-exported from :mod:`polytrain.launchers.cluster.connect`, so
imports written against the older layout keep working.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polytrain.errors import ConfigError, WorkerDiedError
from polytrain.launchers import base
from polytrain.launchers.cluster import autoscaler
from polytrain.launchers.cluster.connect import ensure_ray
from polytrain.launchers.group_calls import MONITOR_GROUP, GroupCalls
from polytrain.launchers.placement import (
    check_feasible,
    not_placed_error,
    trial_placement_group,
    wait_until_placed,
)
from polytrain.launchers.pool import warm_pool as pool
from polytrain.launchers.process_env import resolve_process_env
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


class RayWorkerGroup(GroupCalls, base.WorkerGroup):
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
        env_vars: environment every worker sets on itself when it starts (or is reused).
        process_env: environment the worker processes are started with, through Ray's
            ``runtime_env`` (variables read only at process start, as glibc's
            ``MALLOC_ARENA_MAX``); a value the Ray job's ``runtime_env`` or the
            driver's environment sets wins (see :mod:`polytrain.launchers.process_env`).
            :attr:`process_env` is what the workers got.
        preload: modules new workers import in the background as soon as they start
            (torch, the backend's libraries), while the driver goes on setting up;
            the pool's ``preload`` setting, where set, replaces them.

    Workers come from the warm pool (:mod:`polytrain.launchers.pool.warm_pool`) when it holds
    a group of this shape (:attr:`reused`) and go back to it on a healthy
    :meth:`shutdown`. A pooled group of another size serves too (PACK or SPREAD,
    own placement group; :attr:`resized_from` is its size): a smaller group uses
    its first workers and keeps the others idle beside it until both go back to
    the pool together; a larger one adds the missing workers in a second placement
    group. :attr:`timings`: wall-clock marks of :meth:`start`.

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
        process_env: dict[str, str] | None = None,
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
        self.process_env = (
            resolve_process_env(process_env, _job_env_vars()) if process_env else {}
        )
        configured = pool.get_settings().preload  # set by the user: it wins over the backend's
        self.preload = tuple(configured if configured is not None else (preload or ()))
        self.actors: list[Any] = []
        self.metadata: list[WorkerMetadata] = []
        self.rank_infos: list[RankInfo] = []
        self.device_indices: list[int] = []
        self._autoscaling: autoscaler.ClusterShape | None = None
        self._placement_group = None
        self._owns_placement_group = True
        self._extra_placement_groups: list[Any] = []  # a grown group's added one(s)
        self._spare: list[Any] = []  # a resized larger group's workers this one does not use
        self._spare_metadata: list[WorkerMetadata] = []
        self.reused = False
        self.resized_from: int | None = None
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
        self.resized_from = None
        self.reused = self._start_warm()
        if not self.reused:
            self._start_cold()
        self.rank_infos = compute_ranks([m.node_id for m in self.metadata])
        self._assign_devices()
        self.timings["ready"] = time.time()

    def _start_cold(self) -> None:
        first_bundle = self._reserve_bundles()
        # Actors are created at once: Ray starts them as soon as the bundles are placed.
        actors = self._start_actors(self._placement_group, first_bundle, self.num_workers)
        self.actors = actors
        self._wait_until_placed(self._placement_group, self.num_workers)
        self.timings["placed"] = time.time()
        metadata = self._read_metadata(actors)
        self.timings["actors_ready"] = time.time()
        self._set_rank_order(actors, metadata)

    def _set_rank_order(self, actors: list[Any], metadata: list[WorkerMetadata]) -> None:
        """Co-located workers get contiguous ranks: local ranks follow from world ranks."""
        order = order_by_node([m.node_id for m in metadata])
        self.actors = [actors[i] for i in order]
        self.metadata = [metadata[i] for i in order]

    def _start_warm(self) -> bool:
        """Adopt a pooled group (this shape, else another size); False when there is none."""
        if not pool.is_enabled():
            return False
        trial = trial_placement_group(self.num_workers)
        self._pool_key = pool.PoolKey.of(self, trial)
        resize = trial is None and self.placement_strategy in pool.RESIZABLE_STRATEGIES
        taken = pool.POOL.take_ready(self._pool_key, self.env_vars, resize=resize)
        if taken is None:
            return False
        idle, metadata = taken
        self._placement_group = idle.placement_group
        self._owns_placement_group = idle.owns_placement_group
        self._extra_placement_groups = list(idle.extra_placement_groups)
        self.actors, self.metadata = list(idle.actors), metadata
        if idle.size != self.num_workers:
            self.resized_from = idle.size
            logger.info("Warm pool: %d worker(s) serve a group of %d.", idle.size, self.num_workers)
        if idle.size > self.num_workers:
            n = self.num_workers
            self._spare, self._spare_metadata = self.actors[n:], self.metadata[n:]
            self.actors, self.metadata = self.actors[:n], self.metadata[:n]
        elif idle.size < self.num_workers:
            try:
                self._grow(self.num_workers - idle.size)
            except BaseException:
                self.terminate()  # the adopted workers too: nothing is left running
                raise
        self.timings["placed"] = self.timings["actors_ready"] = time.time()
        return True

    def _grow(self, count: int) -> None:
        """Add ``count`` new workers, in a placement group of their own, to the adopted ones."""
        added = self._new_placement_group(count)
        self._extra_placement_groups.append(added)
        new_actors = self._start_actors(added, 0, count)
        warm_actors, warm_metadata = self.actors, self.metadata
        self.actors = warm_actors + new_actors  # all stopped if the new ones fail to start
        self._wait_until_placed(added, count)
        new_metadata = self._read_metadata(new_actors)
        self._set_rank_order(self.actors, warm_metadata + new_metadata)

    def _requested(self, count: int | None = None) -> str:
        count = self.num_workers if count is None else count
        return f"{count} worker(s) x {self.bundle} ({self.placement_strategy})"

    def _reserve_bundles(self) -> int:
        """Set :attr:`_placement_group` (the trial's own, or a new one); return the first bundle index."""
        current = trial_placement_group(self.num_workers)
        self._pool_key = pool.PoolKey.of(self, current)
        if current is not None:
            # The workers take the last n bundles: Tune puts the trainable's bundle first,
            # and drops it when the trainable reserves nothing.
            self._placement_group, self._owns_placement_group = current, False
            return len(current.bundle_specs) - self.num_workers
        self._placement_group = self._new_placement_group(self.num_workers)
        self._owns_placement_group = True
        return 0

    def _new_placement_group(self, count: int) -> Any:
        """A new placement group of ``count`` bundles, once the request was judged feasible."""
        # Judged against what the cluster can become (the autoscaler's node types) where
        # an autoscaler is visible; against the live nodes otherwise.
        self._autoscaling = autoscaler.judge_request(
            self.bundle, count, self.placement_strategy, self._requested(count)
        )
        if self._autoscaling is None:
            check_feasible(self.bundle, self._requested(count))
        # Idle pooled workers that could hold these bundles yield first: with the pool on,
        # the group lands where it would with the pool off (a soft strategy would not wait
        # for them, it would degrade around them).
        pool.POOL.yield_to(self.bundle)
        return placement_group(
            [dict(self.bundle) for _ in range(count)], strategy=self.placement_strategy
        )

    def _wait_until_placed(self, group: Any, count: int) -> None:
        placed = wait_until_placed(
            group.ready(), self.start_timeout_s, self.bundle, count, self._autoscaling
        )
        if placed:
            return
        used = autoscaler.start_timeout(self.start_timeout_s, self._autoscaling)
        error = not_placed_error(self._requested(count), used)
        self._unhealthy = True
        self.shutdown()
        raise error

    def _start_actors(self, group: Any, first_bundle: int, count: int) -> list[Any]:
        remote_cls = ray.remote(concurrency_groups={MONITOR_GROUP: 2})(Worker)
        # Workers take the driver's CPU priority (Ray's default worker niceness is 15).
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        # Ray merges these env_vars into the job's runtime_env (the rest of it is kept).
        process = {"runtime_env": {"env_vars": self.process_env}} if self.process_env else {}
        return [
            remote_cls.options(
                **process,
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_bundle_index=first_bundle + i,
                ),
                max_restarts=0,
            ).remote(self.env_vars, niceness, self.preload)
            for i in range(count)
        ]

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

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release the workers: back to the warm pool if healthy, else stopped. Safe to call twice.

        Workers whose call raised, died, hung or was interrupted are stopped (actors
        killed, placement groups removed), as are all when the pool is off or full.
        Idle workers kept beside a smaller group go with it.
        """
        actors, self.actors = self.actors + self._spare, []
        metadata = self.metadata + self._spare_metadata
        groups = [self._placement_group, *self._extra_placement_groups]
        self._placement_group, self._extra_placement_groups = None, []
        self._spare, self._spare_metadata = [], []
        if actors and self._release_to_pool(actors, metadata, groups):
            return
        # Removed asynchronously by Ray: the next placement group of this process waits
        # until they are free (pool.POOL.yield_to), or a soft strategy degrades around them.
        owned = groups if self._owns_placement_group else []
        pool.POOL.stop_unpooled(actors, metadata, owned, self.bundle)

    def terminate(self) -> None:
        """Stop every worker now, never keeping them warm (e.g. on Ctrl+C)."""
        self._unhealthy = True
        self.shutdown()

    def _release_to_pool(self, actors: list[Any], metadata: list[Any], groups: list[Any]) -> bool:
        if self._unhealthy or self._waiting or groups[0] is None or not pool.is_enabled():
            return False
        for actor in actors:
            actor.reset.remote()  # Ray runs it before any later call on the actor (reuse)
        idle = pool.IdleGroup(
            key=dataclasses.replace(self._pool_key, num_workers=len(actors)),
            actors=actors,
            metadata=metadata,
            placement_group=groups[0],
            owns_placement_group=self._owns_placement_group,
            extra_placement_groups=groups[1:],
        )
        return pool.POOL.put(idle)


#: The name this class had before the contract was declared; kept for existing imports.
WorkerGroup = RayWorkerGroup


def _job_env_vars() -> dict[str, str]:
    """The ``env_vars`` of the connected Ray job's ``runtime_env`` (none when Ray cannot say)."""
    try:
        runtime_env = ray.get_runtime_context().runtime_env
    except Exception:  # noqa: BLE001 - e.g. an older Ray Client server: no job-level values known
        return {}
    return dict(runtime_env.get("env_vars") or {})
