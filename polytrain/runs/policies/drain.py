"""How many drains a run survives: a drain event in, a decision as data out.

A drain (Ray's announced node loss, :mod:`polytrain.runs.watch.drains`) costs the
run no step: the group stops at a step, checkpoints there and continues off the
node. It is counted apart from lost workers (``max_retries``) and limited by the
front end's drain option (``failure_config max_drains``, Ray Train's
``max_preemption_failures``, a Lightning strategy's ``max_drains``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeaveNodes:
    """Move the group off the draining nodes: tear it down, restart elsewhere from the checkpoint.

    Attributes:
        count: drains of the run so far, this one included.
    """

    count: int


@dataclass(frozen=True)
class StopRun:
    """One drain more than the limit allows: keep the checkpoint and stop the run.

    Attributes:
        count: drains of the run so far, this one included.
        limit: the option's value.
    """

    count: int
    limit: int


class DrainPolicy:
    """Counts the run's drains against the limit and decides what each one does.

    Args:
        max_drains: drains the run survives; None: unlimited (the default, as Ray Train's
            ``max_preemption_failures=-1``).
        option: the option's name as the user set it, for log lines and errors.
    """

    def __init__(self, max_drains: int | None, option: str = "failure_config max_drains") -> None:
        self.max_drains = max_drains
        self.option = option
        self.count = 0

    def decide(self) -> LeaveNodes | StopRun:
        """Count one more drain: :class:`LeaveNodes`, or :class:`StopRun` past the limit."""
        self.count += 1
        if self.max_drains is not None and self.count > self.max_drains:
            return StopRun(self.count, self.max_drains)
        return LeaveNodes(self.count)

    def describe_limit(self) -> str:
        """``failure_config max_drains=3`` or ``...=unlimited``, for a log line."""
        limit = "unlimited" if self.max_drains is None else str(self.max_drains)
        return f"{self.option}={limit}"
