"""Elastic training: the size of a restarted worker group, and when to grow back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from polytrain.errors import InsufficientResourcesError
from polytrain.launchers.cluster.autoscaler import start_timeout
from polytrain.launchers.factory import placeable_workers
from polytrain.launchers.placement import request_workers
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
        request: asks an autoscaler for room for that many workers in all, 0 withdraws
            the ask; returns False without an autoscaler (default:
            :func:`~polytrain.launchers.placement.request_workers`).
    """

    def __init__(
        self,
        scaling: ScalingConfig,
        placeable: Callable[[], int] | None = None,
        request: Callable[[int], bool] | None = None,
    ) -> None:
        self.scaling = scaling
        self._placeable = placeable or (lambda: placeable_workers(scaling))
        self._request = request or (lambda n: request_workers(scaling.worker_bundle(), n))
        self._asked: int | None = None  # workers asked of the autoscaler; None: nothing asked
        self._has_autoscaler = True  # until a request says there is none

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
        timeout_s = start_timeout(self.scaling.start_timeout_s, None)
        deadline = time.monotonic() + timeout_s
        while True:
            fits = min(self._placeable(), self.scaling.num_workers)
            if fits < self.scaling.num_workers:
                self._ask(self.scaling.num_workers)  # an autoscaler replaces the lost nodes
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
                    f"{timeout_s:g}s. Add resources or lower min_workers."
                )
            time.sleep(0.5)

    def should_grow(self, current_size: int) -> bool:
        """At an epoch boundary: True if a group of ``current_size`` now fits in full.

        A shrunk group also asks the autoscaler (if any) for the nodes it lacks: an
        autoscaler adds nodes for pending work only, and a running group has none.
        """
        if current_size >= self.scaling.num_workers:
            self.release()
            return False
        if self._placeable() + current_size < self.scaling.num_workers:
            self._ask(self.scaling.num_workers)
            return False
        logger.warning(
            "Elastic training: resources are back; growing from %d to %d workers.",
            current_size,
            self.scaling.num_workers,
        )
        return True

    def _ask(self, workers: int) -> None:
        if self._has_autoscaler and self._asked != workers:
            self._has_autoscaler = self._request(workers)
            self._asked = workers if self._has_autoscaler else None
            if self._asked:
                logger.warning(
                    "Elastic training: asked the autoscaler for room for %d workers.", workers
                )

    def release(self) -> None:
        """Withdraw an ask made of the autoscaler (at full size, and at shutdown)."""
        if self._asked:
            self._request(0)
            self._asked = None
