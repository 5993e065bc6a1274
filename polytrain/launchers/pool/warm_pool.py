"""The warm worker pool: workers of a finished group wait, ready, for the next group that fits.

A healthy :class:`~polytrain.launchers.worker_group.RayWorkerGroup` that shuts
down (a trainer's ``shutdown()``, the end of a Lightning call, a ``polytrain
compare`` run) resets its actors (:mod:`polytrain.launchers.pool.reset`) and
leaves them here with their placement group, keyed by :class:`PoolKey` (bundle,
worker count, strategy, placement group, Ray session). The next group of exactly
that shape takes the whole group, with torch and the backend imported already; a
group of another world size takes a group of another size
(:meth:`WorkerPool.take_resized`): a smaller one uses the first workers of a
larger group, a larger one adds new workers to a smaller group.

One pool per process. It is bounded: at most ``max_idle`` idle workers (oldest
out first); an idle group is stopped after ``idle_timeout_s``, at once when a
placement group of anyone else waits for resources (``release_on_demand``), and
before this process creates a placement group that could use their resources
(:meth:`WorkerPool.yield_to`: a new group lands where it would without the pool);
everything is stopped at exit. Settings: :func:`configure` or the environment
(:mod:`polytrain.launchers.pool.settings`; ``POLYTRAIN_WARM_POOL=0`` turns it off).
Importing this module does not import Ray.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from polytrain.launchers.pool import release
from polytrain.launchers.pool.groups import (
    RESIZABLE_STRATEGIES,
    IdleGroup,
    PoolKey,
    held_per_node,
    session_token,
    stop_actors,
)
from polytrain.launchers.pool.settings import (
    ENV_IDLE_TIMEOUT,
    ENV_MAX_IDLE,
    ENV_SWITCH,
    PoolSettings,
    get_settings,
    is_enabled,
    reset_settings,
    set_settings,
)

__all__ = [
    "ENV_IDLE_TIMEOUT",
    "ENV_MAX_IDLE",
    "ENV_SWITCH",
    "IdleGroup",
    "PoolKey",
    "PoolSettings",
    "RESIZABLE_STRATEGIES",
    "WorkerPool",
    "clear",
    "configure",
    "get_settings",
    "idle_workers",
    "is_enabled",
    "reset_settings",
    "session_token",
    "stats",
    "stop_actors",
]

logger = logging.getLogger(__name__)

#: Removals older than this are not waited for any more (long done, or never will be).
_RELEASE_HORIZON_S = 120.0


def configure(
    *,
    enabled: bool | None = None,
    max_idle: int | None = None,
    idle_timeout_s: float | None = None,
    release_on_demand: bool | None = None,
    reuse_timeout_s: float | None = None,
    preload: Sequence[str] | None = None,
) -> PoolSettings:
    """Change the warm pool's settings in this process; returns the new settings.

    Each argument is the :class:`PoolSettings` field of that name; None keeps its value.
    Turning the pool off or lowering ``max_idle`` stops the idle workers that no longer
    fit. ``POLYTRAIN_WARM_POOL=0`` turns the pool off whatever is configured here.

    Raises:
        ConfigError: a negative bound; :class:`ConfigTypeError` for a wrong type.
    """
    changes = {
        k: v
        for k, v in {
            "enabled": enabled,
            "max_idle": max_idle,
            "idle_timeout_s": idle_timeout_s,
            "release_on_demand": release_on_demand,
            "reuse_timeout_s": reuse_timeout_s,
            "preload": preload,
        }.items()
        if v is not None
    }
    settings = dataclasses.replace(get_settings(), **changes)
    set_settings(settings)
    POOL.trim()
    return settings


class WorkerPool:
    """The driver process's idle groups (use the module-level :data:`POOL`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._idle: list[IdleGroup] = []
        self._reaper: threading.Thread | None = None
        self._closed = False
        self._atexit_registered = False
        self._pending_seen: set[str] = set()
        self._releasing: list[release.Release] = []  # removals not waited for yet
        self.counts = {"hits": 0, "misses": 0, "resized": 0, "returned": 0, "stopped": 0}

    # ---------------------------------------------------------------- use
    def put(self, group: IdleGroup) -> bool:
        """Keep ``group`` idle; False (the caller stops it) when the pool is off, full or closed."""
        limit = get_settings().max_idle
        with self._lock:
            if self._closed or not is_enabled() or group.size > limit:
                return False
            evicted = self._evict_locked(limit - group.size)
            self._idle.append(group)
            self.counts["returned"] += 1
            self._start_reaper_locked()
        self._stop(evicted)
        return True

    def take(self, key: PoolKey) -> IdleGroup | None:
        """Remove and return the idle group with ``key`` (the newest one), or None."""
        with self._lock:
            for index in range(len(self._idle) - 1, -1, -1):
                if self._idle[index].key == key:
                    self.counts["hits"] += 1
                    return self._idle.pop(index)
            self.counts["misses"] += 1
        return None

    def take_resized(self, key: PoolKey) -> IdleGroup | None:
        """Remove and return an idle group of another size that can serve ``key``, or None.

        See :meth:`PoolKey.resizes_to`. Prefers the smallest group that holds
        ``key.num_workers`` (its other workers wait beside the new group and come
        back with it), then the largest smaller one (fewest workers to add).
        """
        with self._lock:
            fits = [g for g in self._idle if g.key.resizes_to(key)]
            if not fits:
                return None
            larger = [g for g in fits if g.size > key.num_workers]
            chosen = (
                min(larger, key=lambda g: g.size) if larger else max(fits, key=lambda g: g.size)
            )
            self._idle.remove(chosen)
            self.counts["resized"] += 1
        return chosen

    def take_ready(
        self, key: PoolKey, env_vars: dict[str, str], resize: bool = False
    ) -> tuple[IdleGroup, list[Any]] | None:
        """Take a group and make its workers ready: ``(group, metadata in rank order)``.

        :meth:`take` first; with ``resize`` then :meth:`take_resized` (the group may
        have another size than ``key``). Every worker gets ``env_vars`` on top of its
        start environment, after its reset finished. A group whose reset failed, or
        that died or hangs while idle, is stopped and None returned: the caller
        starts fresh actors.
        """
        import ray

        idle = self.take(key)
        if idle is None and resize:
            idle = self.take_resized(key)
        if idle is None:
            return None
        try:
            metadata = ray.get(
                [actor.reuse.remote(env_vars) for actor in idle.actors],
                timeout=get_settings().reuse_timeout_s,
            )
        except Exception:  # noqa: BLE001 - died or stuck while idle
            logger.debug("a pooled group could not be reused", exc_info=True)
            metadata = [None]
        if any(m is None for m in metadata):
            self._stop([idle])
            return None
        return idle, list(metadata)

    def yield_to(self, bundle: dict[str, float], wait_s: float = 30.0) -> int:
        """Stop the idle groups holding resources a new placement group of ``bundle`` could use.

        Called before a placement group of this process is created, so that it lands
        where it would without the pool: a soft strategy never waits for idle workers
        (SPREAD would pack beside them, PACK spread), a strict one would wait for the
        reaper. Groups with their own placement group whose bundle shares a resource
        with ``bundle`` yield; a Tune trial's bundles stay with the trial anyway, and
        a group that serves the new one was taken out of the pool before. Waits (at
        most ``wait_s``; about a second on a quiet machine) until their resources are
        really free on every node (:func:`~polytrain.launchers.pool.release.wait_until_released`):
        Ray gives a removed placement group's bundles back asynchronously, and a group
        placed before that degrades around them. Returns the number of groups stopped.
        """
        wanted = {resource for resource, amount in bundle.items() if amount > 0}
        with self._lock:
            yielding = [
                g
                for g in self._idle
                if g.owns_placement_group and wanted & {r for r, a in g.key.bundle if a > 0}
            ]
            self._idle = [g for g in self._idle if g not in yielding]
        self._stop_and_wait(yielding, wait_s)  # and any earlier removal still in flight
        return len(yielding)

    def _stop_and_wait(self, groups: Sequence[IdleGroup], wait_s: float) -> None:
        """Stop ``groups`` and wait (at most ``wait_s``) until what they held is free on every node."""
        self._stop(groups)
        self.wait_for_releases(wait_s)

    def stop_unpooled(
        self,
        actors: Sequence[Any],
        metadata: Sequence[Any],
        placement_groups: Sequence[Any],
        bundle: dict[str, float],
    ) -> None:
        """Stop a group that does not go back to the pool; its release is waited for like the pool's.

        Args:
            actors: the workers (killed).
            metadata: where each worker runs (its ``node_id``), in the order of ``actors``.
            placement_groups: the group's own placement groups (removed; none for a Tune
                trial's, which stay with the trial).
            bundle: the per-worker bundle.
        """
        owned = [pg for pg in placement_groups if pg is not None]
        self._note_release([held_per_node(metadata, bundle.items())], owned)
        stop_actors(actors, *owned)

    def wait_for_releases(self, wait_s: float = 30.0) -> bool:
        """Wait (at most ``wait_s``) until the placement groups this process removed are free.

        Every removal of this process's pool or groups since the last wait (see
        :mod:`polytrain.launchers.pool.release`); True when all of them are complete.
        """
        with self._lock:
            pending, self._releasing = self._releasing, []
        if not pending:
            return True
        return release.wait_until_released(pending, wait_s)

    def _note_release(
        self, held_by_group: Sequence[dict[str, dict[str, float]]], pgs: Sequence[Any]
    ) -> None:
        """Record placement groups about to be removed (Ray up, this session's), for the next wait."""
        import ray

        if not pgs or not ray.is_initialized():
            return
        try:
            entry = release.begin(held_by_group, pgs)
        except Exception:  # noqa: BLE001 - Ray going down: nothing to wait for
            return
        with self._lock:
            horizon = time.monotonic() - _RELEASE_HORIZON_S
            self._releasing = [r for r in self._releasing if r.started > horizon] + [entry]

    def trim(self) -> None:
        """Apply the current settings now: stop what is over ``max_idle`` (all when off)."""
        with self._lock:
            evicted = self._evict_locked(get_settings().max_idle if is_enabled() else -1)
        self._stop(evicted)

    def clear(self, wait_s: float = 0.0) -> int:
        """Stop every idle worker now; returns how many were stopped.

        ``wait_s``: wait up to that long until Ray shows their resources free.
        """
        with self._lock:
            groups, self._idle = self._idle, []
        if wait_s > 0 and groups:
            self._stop_and_wait(groups, wait_s)
        else:
            self._stop(groups)
        return sum(g.size for g in groups)

    def idle_workers(self) -> int:
        """Idle workers held now."""
        with self._lock:
            return sum(g.size for g in self._idle)

    def stats(self) -> dict[str, int]:
        """Idle groups and workers now; counts of hits, misses, resized, returned, stopped groups."""
        with self._lock:
            return {
                "idle_groups": len(self._idle),
                "idle_workers": sum(g.size for g in self._idle),
                **self.counts,
            }

    # ----------------------------------------------------------- internals
    def _evict_locked(self, room: int) -> list[IdleGroup]:
        """Take the oldest groups out until at most ``room`` workers stay idle (-1: all)."""
        evicted = []
        while self._idle and (room < 0 or sum(g.size for g in self._idle) > room):
            evicted.append(self._idle.pop(0))
        return evicted

    def _stop(self, groups: Sequence[IdleGroup]) -> None:
        if not groups:
            return
        import ray

        try:
            session = session_token() if ray.is_initialized() else None
        except Exception:  # noqa: BLE001 - Ray going down: their stop does nothing
            session = None
        ours = [g for g in groups if g.key.session == session]
        self._note_release(
            [g.held_per_node() for g in ours], [pg for g in ours for pg in g.owned_placement_groups]
        )
        for group in groups:
            group.stop()
        with self._lock:
            self.counts["stopped"] += len(groups)

    def _start_reaper_locked(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(
                target=self._reap_loop, name="polytrain-pool-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_loop(self) -> None:
        """Stop expired groups, and all owned ones when others wait; exit once the pool is empty."""
        while True:
            time.sleep(max(0.05, min(1.0, get_settings().idle_timeout_s / 2)))
            with self._lock:
                if not self._idle:
                    self._reaper = None
                    return
            session, waiting = self._cluster_facts()  # Ray calls: outside the lock
            with self._lock:
                done = self._due_locked(session, waiting)
                self._idle = [g for g in self._idle if g not in done]
            self._stop(done)

    def _cluster_facts(self) -> tuple[str | None, bool]:
        """The Ray session now (None: Ray is down or the pool off) and whether others wait."""
        import ray

        try:
            if not ray.is_initialized() or not is_enabled():
                return None, False
            session = session_token()
        except Exception:  # noqa: BLE001 - Ray going down: stop everything
            return None, False
        return session, get_settings().release_on_demand and self._others_waiting()

    def _due_locked(self, session: str | None, others_waiting: bool) -> list[IdleGroup]:
        """Groups to stop now: expired, from another Ray session, or wanted by others."""
        if session is None:
            return list(self._idle)
        now = time.monotonic()
        timeout = get_settings().idle_timeout_s
        due = [g for g in self._idle if g.key.session != session or now - g.released_at >= timeout]
        if others_waiting:
            due += [g for g in self._idle if g.owns_placement_group and g not in due]
        return due

    def _others_waiting(self) -> bool:
        """True when a placement group has waited for resources through two checks in a row."""
        import ray

        try:
            table = ray.util.placement_group_table()
        except Exception:  # noqa: BLE001 - no table (e.g. Ray Client): rely on the timeout
            return False
        pending = {pg_id for pg_id, info in table.items() if info.get("state") == "PENDING"}
        waiting = pending & self._pending_seen
        self._pending_seen = pending
        return bool(waiting)

    def close(self) -> None:
        """Stop everything and accept no more groups (at driver exit)."""
        with self._lock:
            self._closed = True
        import ray

        if ray.is_initialized():
            self.clear()
        else:
            with self._lock:
                self._idle = []


#: This process's pool.
POOL = WorkerPool()


def clear() -> int:
    """Stop every idle worker of this process's pool now; returns how many."""
    return POOL.clear()


def idle_workers() -> int:
    """Idle workers in this process's pool now."""
    return POOL.idle_workers()


def stats() -> dict[str, int]:
    """This process's pool: idle groups and workers; hits, misses, resized, returned, stopped groups."""
    return POOL.stats()
