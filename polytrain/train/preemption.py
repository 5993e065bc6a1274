"""Drained nodes in the function API: what the loop learns, and how its group leaves the node.

A cloud preemption or an autoscaler's scale-down reaches Ray as a *drain* of a
node, usually with a deadline; Ray Train's API calls it a *preemption*
(``get_preemption_info``, ``PreemptionInfo``, ``max_preemption_failures``), and
this module keeps Ray's names. While ``fit()`` runs, the run loop watches Ray's
draining nodes (:class:`~polytrain.runs.watch.drains.DrainWatch`) and,
when a node of the group starts draining, posts a :class:`PreemptionInfo` on the
run's report board. The board hands it out from a report number that no rank has
reached yet, so every rank's ``report()`` call of that number, and of every later
one, brings it back: :func:`polytrain.train.get_preemption_info` returns the
answer of the last ``report()``, the same on every rank at the same call.

The first ``report()`` with a checkpoint from then on is the loop's last in this
group: once every rank has reported that step (and so the checkpoint is
committed), ``report()`` ends the loop on every rank with :class:`LoopPreempted`,
which the worker catches (:func:`polytrain.train.worker_entry.run_loop` returns a
:class:`LoopStopped`), and the driver restarts the group off the node from that
checkpoint. Nothing here needs a cluster: the board and the info are plain objects.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

from polytrain.errors import ConfigError, PolytrainError
from polytrain.runs.watch.drains import PREEMPTION, DrainEvent, DrainingNode

#: Why a node drains: a preemption (a spot instance reclaimed, a maintenance event).
#: Ray reports a drain's deadline but not its reason; it refuses an idle-termination
#: drain of a node that runs work, so a drain seen under a running group is a preemption.
REASON_PREEMPTION = PREEMPTION
#: Why a node drains: the autoscaler ends an idle node.
REASON_IDLE_TERMINATION = "idle termination"
REASONS = (REASON_PREEMPTION, REASON_IDLE_TERMINATION)


@dataclass(frozen=True)
class PreemptionInfo:
    """A node of this run's worker group is draining (Ray Train's ``PreemptionInfo``, widened).

    What :func:`polytrain.train.get_preemption_info` returns. The first fields name the
    draining node (the one with the earliest deadline when several drain); ``nodes``
    holds every one of them.

    Attributes:
        node_id: the draining node's Ray node id (hex).
        node_ip: its IP address.
        reason: why it drains: ``"preemption"`` or ``"idle termination"``.
        deadline_ms: when it will be killed (Unix time in ms); None: no deadline announced.
        ranks: the world ranks of this run's workers on the draining node(s).
        nodes: every draining node of the group (id, IP, ranks, deadline), earliest
            deadline first.

    Ray Train's names work too: :attr:`preempted_node_to_ranks`,
    :attr:`preempted_node_ids`, :attr:`preempted_ranks`.
    """

    node_id: str
    node_ip: str
    reason: str
    deadline_ms: int | None
    ranks: tuple[int, ...]
    nodes: tuple[DrainingNode, ...]

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ConfigError(
                f"PreemptionInfo(reason={self.reason!r}) is not a drain reason; it must be one "
                f"of {REASONS}."
            )

    @classmethod
    def from_nodes(
        cls, nodes: tuple[DrainingNode, ...] | list[DrainingNode], reason: str = REASON_PREEMPTION
    ) -> PreemptionInfo:
        """The info of ``nodes`` (at least one): earliest deadline first, ranks of them all.

        Raises:
            ConfigError: no node, or an unknown ``reason``.
        """
        if not nodes:
            raise ConfigError(
                "PreemptionInfo.from_nodes() needs at least one draining node; got none."
            )
        ordered = tuple(
            sorted(nodes, key=lambda n: (n.deadline_ms is None, n.deadline_ms or 0, n.node_id))
        )
        first = ordered[0]
        return cls(
            node_id=first.node_id,
            node_ip=first.node_ip,
            reason=reason,
            deadline_ms=first.deadline_ms,
            ranks=tuple(sorted({rank for node in ordered for rank in node.ranks})),
            nodes=ordered,
        )

    @classmethod
    def from_event(
        cls, event: DrainEvent, previous: PreemptionInfo | None = None
    ) -> PreemptionInfo:
        """The info of a drain watch's event, with the nodes of ``previous`` still draining."""
        known = {node.node_id: node for node in (previous.nodes if previous else ())}
        known.update((node.node_id, node) for node in event.nodes)
        return cls.from_nodes(list(known.values()), event.reason)

    @property
    def deadline(self) -> datetime.datetime | None:
        """The deadline as a UTC datetime; None: no deadline announced."""
        if self.deadline_ms is None:
            return None
        return datetime.datetime.fromtimestamp(self.deadline_ms / 1000.0, tz=datetime.timezone.utc)

    def seconds_left(self, now_s: float | None = None) -> float | None:
        """Seconds until the deadline (negative once past); None: no deadline announced.

        Args:
            now_s: the Unix time to count from; default: now.
        """
        if self.deadline_ms is None:
            return None
        return self.deadline_ms / 1000.0 - (time.time() if now_s is None else now_s)

    @property
    def preempted_node_to_ranks(self) -> dict[str, list[int]]:
        """Ray Train's name: each draining node's id to the world ranks on it."""
        return {node.node_id: sorted(node.ranks) for node in self.nodes}

    @property
    def preempted_node_ids(self) -> list[str]:
        """Ray Train's name: the draining nodes' ids, sorted."""
        return sorted(node.node_id for node in self.nodes)

    @property
    def preempted_ranks(self) -> list[int]:
        """Ray Train's name: every world rank on a draining node, sorted."""
        return list(self.ranks)

    def describe(self, now_s: float | None = None) -> str:
        """``Node <id> (<ip>) is draining (<reason>, deadline in <s> s)``, one clause per node."""
        return "; ".join(node.describe(self.reason, now_s) for node in self.nodes)


@dataclass(frozen=True)
class LoopStopped:
    """What a worker's loop returns when a drain stopped it at a checkpoint (driver reads it).

    Attributes:
        index: the report number (the board's, counted over the run) whose checkpoint
            the loop stopped at.
    """

    index: int


class LoopPreempted(PolytrainError):
    """Raised by ``report()`` to end the loop at the checkpoint reported after a drain.

    Not an error: the loop must end there on every rank (or a rank would wait in a
    collective the others have left), so let it propagate; the worker catches it
    around the loop, and the loop's ``finally`` blocks and ``with`` exits run. A loop
    that swallows it (``except Exception``) gets it again from every later
    ``report()``, and still ends as stopped.
    """

    def __init__(self, index: int) -> None:
        super().__init__(
            f"The loop stops at report {index}: a node of the group is draining, and this "
            f"report's checkpoint is where the group continues off it. Let this exception "
            f"propagate (re-raise it from an `except Exception` block)."
        )
        self.index = index


__all__ = [
    "REASONS",
    "REASON_IDLE_TERMINATION",
    "REASON_PREEMPTION",
    "LoopPreempted",
    "LoopStopped",
    "PreemptionInfo",
]
