"""Waiting until stopped groups' resources are really free, before a new placement group is made.

Ray removes a placement group asynchronously: ``remove_placement_group`` returns at
once, the GCS marks the group removed and asks each raylet to give its bundles back,
and the raylets report their resources a moment later (longer on a loaded machine). A
placement group created in between is scheduled against nodes that still hold the
old bundles, and a soft strategy degrades around them: SPREAD puts both bundles on the
node that freed first, where a fresh cluster spreads them. :func:`wait_until_released`
waits, node by node, until what the stopped groups held is back: their placement
groups removed, no bundle resource of theirs left on any node, and each node's
available resources up by what the groups held there. :class:`Release` records a removal
(:func:`begin`, right before it); the pool waits on every removal of this process still in
flight before the next placement group. Importing this module does not import Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: ``{node id: {resource: amount}}``.
PerNode = dict[str, dict[str, float]]

_EPS = 1e-6


@dataclass(frozen=True)
class Snapshot:
    """The cluster's available resources at one moment: per node where Ray says, and summed."""

    per_node: PerNode | None
    total: dict[str, float]


def snapshot() -> Snapshot:
    """The available resources now (per node: None on a Ray Client connection)."""
    from ray._private import state

    try:
        per_node = {k: dict(v) for k, v in state.available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - no GCS accessor here: the sums only
        per_node = None
    if per_node is None:
        import ray

        return Snapshot(None, dict(ray.available_resources()))
    total: dict[str, float] = {}
    for resources in per_node.values():
        for resource, amount in resources.items():
            total[resource] = total.get(resource, 0.0) + amount
    return Snapshot(per_node, total)


@dataclass
class Release:
    """Placement groups this process is removing, and what their bundles held on each node.

    Attributes:
        held: ``{node id: {resource: amount}}`` of the groups' bundles.
        placement_groups: the groups being removed.
        before: :func:`snapshot` taken right before they were removed.
        started: ``time.monotonic()`` of the removal.
    """

    held: PerNode
    placement_groups: list[Any]
    before: Snapshot
    started: float = field(default_factory=time.monotonic)


def begin(
    held_by_group: Sequence[Mapping[str, Mapping[str, float]]], placement_groups: Sequence[Any]
) -> Release:
    """Record what is about to be removed (call right before removing it)."""
    held: PerNode = {}
    for per_node in held_by_group:
        for node, resources in per_node.items():
            node_held = held.setdefault(node, {})
            for resource, amount in resources.items():
                node_held[resource] = node_held.get(resource, 0.0) + amount
    return Release(held, list(placement_groups), snapshot())


def wait_until_released(releases: Sequence[Release], wait_s: float) -> bool:
    """Wait (at most ``wait_s``) until every release is complete; True if they all are.

    Complete: each placement group is removed in Ray's table, no node lists a bundle
    resource of it any more, and each node's available resources are up by what the
    bundles held there (capped at the node's total; a node that left counts as done).
    """
    import ray

    deadline = time.monotonic() + wait_s
    pending = list(releases)
    while pending:
        now = snapshot()
        pending = [r for r in pending if not (_removed(ray, r) and _freed(r, now))]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            logger.warning(
                "Resources of %d stopped worker group(s) were not free after %.0f s; the new "
                "placement group is created anyway.",
                sum(len(r.placement_groups) for r in pending),
                wait_s,
            )
            return False
        time.sleep(0.05)
    return True


def _removed(ray: Any, release: Release) -> bool:
    for pg in release.placement_groups:
        try:
            state = ray.util.placement_group_table(pg).get("state")
        except Exception:  # noqa: BLE001 - unknown to the GCS: gone
            continue
        if state not in (None, "REMOVED"):
            return False
    return True


def _freed(release: Release, now: Snapshot) -> bool:
    """Whether every node shows what the release's bundles held there as available again."""
    before, held = release.before, release.held
    if before.per_node is None or now.per_node is None:
        return _freed_in_sums(held, before.total, now.total)
    from ray._private import state

    ids = [pg.id.hex() for pg in release.placement_groups]
    totals = state.total_resources_per_node()
    for node, resources in held.items():
        if node not in now.per_node:  # the node is gone: nothing to wait for there
            continue
        total = totals.get(node, {})
        if any(pg_id in name for name in total for pg_id in ids):
            return False  # the raylet still lists a bundle of a stopped group
        was = before.per_node.get(node, {})
        for resource, amount in resources.items():
            wanted = min(was.get(resource, 0.0) + amount, total.get(resource, 0.0))
            if now.per_node[node].get(resource, 0.0) < wanted - _EPS:
                return False
    return True


def _freed_in_sums(
    held: Mapping[str, Mapping[str, float]], before: dict[str, float], now: dict[str, float]
) -> bool:
    """Without a per-node view: the cluster-wide sums are up by what the groups held."""
    wanted: dict[str, float] = {}
    for resources in held.values():
        for resource, amount in resources.items():
            wanted[resource] = wanted.get(resource, 0.0) + amount
    return all(now.get(r, 0.0) >= before.get(r, 0.0) + a - _EPS for r, a in wanted.items())
