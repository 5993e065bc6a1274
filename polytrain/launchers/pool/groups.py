"""What the warm pool holds: the key of a released group and the group itself.

:class:`PoolKey` is the shape a group holds (bundle, size, strategy, placement
group, Ray session); :class:`IdleGroup` a released group's actors and the
placement groups they live in. :mod:`polytrain.launchers.pool.warm_pool` keeps them.
Importing this module does not import Ray.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Strategies under which a group may span several placement groups (a warm group
#: grown by a second one): both are preferences, which two groups still honour.
#: STRICT_PACK and STRICT_SPREAD promise one node / distinct nodes for the whole
#: group, which only a single placement group can keep.
RESIZABLE_STRATEGIES = ("PACK", "SPREAD")


def session_token() -> str:
    """Which Ray session (and job) the driver is connected to now: pooled actors belong to one."""
    import ray

    ctx = ray.get_runtime_context()
    try:
        session = ctx.get_session_name()
    except Exception:  # noqa: BLE001 - e.g. a Ray Client connection: the job id alone
        session = "?"
    return f"{session}/{ctx.get_job_id()}"


@dataclass(frozen=True)
class PoolKey:
    """What a pooled group holds; a new group takes one of exactly its shape first.

    Failing that, a group of another size can be resized (see :meth:`resizes_to`).

    Attributes:
        bundle: the per-worker bundle, as sorted (resource, amount) pairs.
        num_workers: the number of workers.
        strategy: the placement strategy.
        scope: ``"own"`` for a group with its own placement group, else the hex id of
            the (Tune trial's) placement group its workers live in.
        session: :func:`session_token` when the group started.
        process_env: what the processes were started with (Ray ``runtime_env``
            ``env_vars``, fixed for a process's life), as sorted pairs.
    """

    bundle: tuple[tuple[str, float], ...]
    num_workers: int
    strategy: str
    scope: str
    session: str
    process_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, group: Any, placement_group: Any = None) -> PoolKey:
        """The key of ``group`` now; ``placement_group``: the trial's its workers live in, if any."""
        scope = "own" if placement_group is None else placement_group.id.hex()
        bundle = tuple(sorted(group.bundle.items()))
        process_env = tuple(sorted(group.process_env.items()))
        return cls(
            bundle, group.num_workers, group.placement_strategy, scope, session_token(), process_env
        )

    def resizes_to(self, wanted: PoolKey) -> bool:
        """True if a pooled group of this key can serve ``wanted`` at another size.

        Only groups with placement groups of their own (never a Tune trial's, whose
        bundles are the trial's) and a soft strategy (:data:`RESIZABLE_STRATEGIES`),
        with the same bundle, strategy, Ray session and process environment.
        """
        return (
            self.num_workers != wanted.num_workers
            and self.scope == wanted.scope == "own"
            and self.strategy == wanted.strategy
            and self.strategy in RESIZABLE_STRATEGIES
            and self.bundle == wanted.bundle
            and self.session == wanted.session
            and self.process_env == wanted.process_env
        )


@dataclass
class IdleGroup:
    """A released group waiting in the pool: actors in rank order, their placement group(s).

    ``extra_placement_groups``: the groups a grown group added to its first one (all
    owned by the group, like the first when ``owns_placement_group``).

    Its workers' ``reset()`` calls may still be running: the group that takes it
    calls ``reuse()`` next, which Ray runs after them on each actor.
    """

    key: PoolKey
    actors: list[Any]
    metadata: list[Any]
    placement_group: Any
    owns_placement_group: bool
    released_at: float = field(default_factory=time.monotonic)
    extra_placement_groups: list[Any] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Number of workers."""
        return len(self.actors)

    @property
    def owned_placement_groups(self) -> list[Any]:
        """The placement groups :meth:`stop` removes (none when a Tune trial owns them)."""
        if not self.owns_placement_group:
            return []
        return [g for g in (self.placement_group, *self.extra_placement_groups) if g is not None]

    def held_per_node(self) -> dict[str, dict[str, float]]:
        """``{node id: {resource: amount}}``: what the group's own bundles hold on each node."""
        return held_per_node(self.metadata, self.key.bundle) if self.owned_placement_groups else {}

    def stop(self) -> None:
        """Kill the actors, remove an own placement group (an earlier session's: forget them)."""
        import ray

        try:
            current = session_token() if ray.is_initialized() else None
        except Exception:  # noqa: BLE001 - Ray going down
            current = None
        if current == self.key.session:
            owned = [self.placement_group, *self.extra_placement_groups]
            stop_actors(self.actors, *(owned if self.owns_placement_group else ()))


def stop_actors(actors: Sequence[Any], *placement_groups: Any) -> None:
    """Kill ``actors`` and remove ``placement_groups`` (None entries are skipped); errors are ignored."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        with contextlib.suppress(Exception):  # already dead is fine
            ray.kill(actor, no_restart=True)
    for placement_group in placement_groups:
        if placement_group is not None:
            with contextlib.suppress(Exception):  # already removed is fine
                remove_placement_group(placement_group)


def held_per_node(
    metadata: Sequence[Any], bundle: Iterable[tuple[str, float]]
) -> dict[str, dict[str, float]]:
    """``{node id: {resource: amount}}`` of one ``bundle`` per worker (``metadata``: where each runs)."""
    items = list(bundle)
    held: dict[str, dict[str, float]] = {}
    for meta in metadata:
        node = held.setdefault(getattr(meta, "node_id", "?"), {})
        for resource, amount in items:
            node[resource] = node.get(resource, 0.0) + amount
    return held
