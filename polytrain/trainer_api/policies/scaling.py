"""Elastic training: the size of a restarted worker group, and when to grow back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from polytrain.errors import InsufficientResourcesError
from polytrain.launchers.factory import placeable_workers
from polytrain.launchers.scaling import ScalingConfig

logger = logging.getLogger(__name__)


class ScalingPolicy:
    """How many workers a (re)started group gets.

    Without ``min_workers`` a group always has ``num_workers``. With it, a group
    restarted after a failure gets as many workers as the cluster holds now
    (between ``min_workers`` and ``num_workers``), and a shrunk group grows back to
    ``num_workers`` at an epoch boundary once the resources return.

    Args:
        scaling: the trainer's scaling options.
        placeable: how many more workers the cluster's free resources hold now
            (default: asks Ray, see :func:`~polytrain.launchers.factory.placeable_workers`).
    """

    def __init__(self, scaling: ScalingConfig, placeable: Callable[[], int] | None = None) -> None:
        self.scaling = scaling
        self._placeable = placeable or (lambda: placeable_workers(scaling))

    @property
    def elastic(self) -> bool:
        """True if a group may run with fewer than ``num_workers`` workers."""
        return self.scaling.min_workers is not None

    def restart_size(self) -> int:
        """The size of a group restarted after a failure.

        Elastic: waits up to ``start_timeout_s`` until at least ``min_workers`` fit.

        Raises:
            InsufficientResourcesError: fewer than ``min_workers`` fit in time.
        """
        if not self.elastic:
            return self.scaling.num_workers
        minimum = self.scaling.min_workers or self.scaling.num_workers
        time.sleep(1.0)  # freed resources reach the cluster's view (and pending demands) first
        deadline = time.monotonic() + self.scaling.start_timeout_s
        while True:
            fits = min(self._placeable(), self.scaling.num_workers)
            if fits >= minimum:
                if fits < self.scaling.num_workers:
                    logger.warning(
                        "Elastic training: continuing on %d of %d workers (min_workers=%d).",
                        fits,
                        self.scaling.num_workers,
                        minimum,
                    )
                return fits
            if time.monotonic() > deadline:
                raise InsufficientResourcesError(
                    f"After a failure the cluster holds only {fits} worker(s), fewer than "
                    f"min_workers={minimum}, within start_timeout_s="
                    f"{self.scaling.start_timeout_s:g}s. Add resources or lower min_workers."
                )
            time.sleep(0.5)

    def should_grow(self, current_size: int) -> bool:
        """At an epoch boundary: True if a group of ``current_size`` now fits in full."""
        if current_size >= self.scaling.num_workers:
            return False
        if self._placeable() + current_size < self.scaling.num_workers:
            return False
        logger.warning(
            "Elastic training: resources are back; growing from %d to %d workers.",
            current_size,
            self.scaling.num_workers,
        )
        return True
