"""The drain watch: Ray announces that a node of the group is about to go.

A cloud preemption or an autoscaler's scale-down announces itself in Ray as a
*drain*: the node is marked draining, optionally with a deadline after which it is
killed (``ray drain-node``; autoscaler v2 makes the same GCS call), and Ray schedules
nothing new on it. polytrain calls this event a **drain** everywhere (Ray Train's
function API keeps Ray's word, *preemption*: ``get_preemption_info``).
:class:`DrainWatch` polls Ray's draining nodes (at most once a second, from the run
loop's poll hook) and reports a drain of a node that hosts workers of the group as a
:class:`DrainEvent`: data the run loop (:mod:`polytrain.runs.loop`) and the drain
policy (:mod:`polytrain.runs.policies.drain`) act on. The Ray call is injected, so
the watch is tested without a cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds between two looks at Ray's draining nodes.
POLL_INTERVAL_S = 1.0

#: Why a node drains, as far as Ray tells. Ray 2.60 reports draining nodes with their
#: deadline only; a node running work is drained for preemption (the raylet refuses an
#: idle-termination drain of a busy node), so that is the reason of any drain seen here.
PREEMPTION = "preemption"


@dataclass(frozen=True)
class DrainingNode:
    """A draining node that hosts workers of the group.

    Attributes:
        node_id: Ray's node id (hex).
        node_ip: the node's IP address.
        ranks: world ranks of the group's workers on it.
        deadline_ms: when the node will be killed (Unix ms), None: no deadline announced.
    """

    node_id: str
    node_ip: str
    ranks: tuple[int, ...]
    deadline_ms: int | None

    def seconds_left(self, now_s: float | None = None) -> float | None:
        """Seconds until the deadline (negative once past); None without a deadline."""
        if self.deadline_ms is None:
            return None
        return self.deadline_ms / 1000.0 - (time.time() if now_s is None else now_s)

    def describe(self, reason: str, now_s: float | None = None) -> str:
        """``Node <id> (<ip>) is draining (<reason>, deadline in <s> s)``."""
        left = self.seconds_left(now_s)
        if left is None:
            deadline = "no deadline"
        else:
            deadline = f"deadline in {left:.0f} s" if left >= 0 else "deadline passed"
        return f"Node {self.node_id} ({self.node_ip}) is draining ({reason}, {deadline})"


@dataclass(frozen=True)
class DrainEvent:
    """Nodes of the group that started draining (the run loop stops the call and moves off them).

    Attributes:
        nodes: the draining nodes that host workers, earliest deadline first.
        reason: why they drain (:data:`PREEMPTION`).
    """

    nodes: tuple[DrainingNode, ...]
    reason: str = PREEMPTION

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The draining nodes' ids."""
        return tuple(node.node_id for node in self.nodes)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank on a draining node."""
        return tuple(sorted(r for node in self.nodes for r in node.ranks))

    def seconds_left(self, now_s: float | None = None) -> float | None:
        """Seconds until the earliest deadline; None if no node announced one."""
        left = [s for s in (n.seconds_left(now_s) for n in self.nodes) if s is not None]
        return min(left) if left else None

    def describe(self, now_s: float | None = None) -> str:
        """One line per node: which node, why, and the deadline."""
        return "; ".join(node.describe(self.reason, now_s) for node in self.nodes)

    def describe_ranks(self) -> str:
        """``rank 1`` or ``ranks 2, 3``: the ranks on the draining nodes, for a log line."""
        return ranks_phrase(self.ranks)

    def merged(self, other: DrainEvent | None) -> DrainEvent:
        """This event with the nodes of an earlier one not acted on yet (``other``) in front."""
        if other is None:
            return self
        return DrainEvent(other.nodes + self.nodes, self.reason)

    def deadline_note(self, now_s: float | None = None) -> str:
        """``no deadline`` or ``<s> s before the deadline`` (the earliest), for a log line."""
        return deadline_phrase(self.seconds_left(now_s))


def deadline_phrase(seconds_left: float | None) -> str:
    """``no deadline`` or ``<s> s before the deadline``, as the drain log lines say it."""
    return "no deadline" if seconds_left is None else f"{seconds_left:.0f} s before the deadline"


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 2, 3``, as the drain log lines name the workers."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def ray_draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: ``{node_id_hex: deadline_ms}`` (0: no deadline)."""
    import ray

    return dict(ray._private.state.state.get_draining_nodes() or {})


class DrainWatch:
    """Watches Ray's draining nodes for those that host workers of the current group.

    Call :meth:`watch` with the group's worker placements after every start, and
    :meth:`poll` as often as convenient (it looks at most every ``interval_s``).

    Args:
        enabled: False makes :meth:`poll` a no-op (local mode: there is no cluster).
        draining: returns ``{node_id_hex: deadline_ms}`` (0: no deadline); default:
            :func:`ray_draining_nodes`.
        interval_s: the least time between two looks.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        enabled: bool = True,
        draining: Callable[[], Mapping[str, int]] | None = None,
        interval_s: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self._draining = draining or ray_draining_nodes
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._nodes: dict[str, tuple[str, tuple[int, ...]]] = {}  # node id -> (ip, ranks)
        self._reported: set[str] = set()
        #: Every draining node of the cluster at the last look (ours or not): no
        #: restarted group may count on their resources.
        self.draining: frozenset[str] = frozenset()

    def watch(self, placements: Sequence[Any]) -> None:
        """Watch the nodes of a new group: one ``(node_id, node_ip)`` record per rank.

        Records are :class:`~polytrain.launchers.ranks.WorkerMetadata` or anything with
        ``node_id`` and ``node_ip`` attributes.
        """
        nodes: dict[str, tuple[str, list[int]]] = {}
        for rank, meta in enumerate(placements):
            nodes.setdefault(meta.node_id, (meta.node_ip, []))[1].append(rank)
        self._nodes = {nid: (ip, tuple(ranks)) for nid, (ip, ranks) in nodes.items()}

    def poll(self, force: bool = False) -> DrainEvent | None:
        """An event when a node of the group started draining since the last look, else None.

        A node is reported once; a failed look (the GCS busy) is logged and skipped.
        ``force`` looks now even if the last look was less than ``interval_s`` ago.
        """
        if not self.enabled or not self._nodes:
            return None
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._interval_s:
            return None
        self._last = now
        try:
            draining = dict(self._draining())
        except Exception as exc:  # noqa: BLE001 - a missed look is retried at the next one
            logger.debug("Could not read Ray's draining nodes: %s", exc)
            return None
        self.draining = frozenset(draining)
        return self.event_for(draining)

    def event_for(self, draining: Mapping[str, int]) -> DrainEvent | None:
        """The event for ``draining`` (``{node_id: deadline_ms}``): the group's nodes not reported yet."""
        new = [
            DrainingNode(nid, ip, ranks, _deadline(draining[nid]))
            for nid, (ip, ranks) in self._nodes.items()
            if nid in draining and nid not in self._reported
        ]
        if not new:
            return None
        self._reported.update(node.node_id for node in new)
        new.sort(key=lambda n: (n.deadline_ms is None, n.deadline_ms or 0, n.node_id))
        return DrainEvent(tuple(new))


def _deadline(deadline_ms: int) -> int | None:
    # 0 means none (ray drain-node without --deadline-remaining-seconds); so does Ray's
    # "forever" (2**63 - 1), which its own tests use.
    deadline_ms = int(deadline_ms)
    return deadline_ms if 0 < deadline_ms < 2**62 else None
