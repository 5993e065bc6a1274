"""The driver side of a backend: connect a started worker group, and release it.

Like Ray Train's ``Backend``: driver hooks only, and no framework imported here.
A rendezvous sends module-level functions to the workers (through the
:class:`~polytrain.launchers.base.WorkerGroup` contract); those functions import
their framework inside the worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polytrain.backends.core.context import WorkerContext
    from polytrain.launchers.base import WorkerGroup

logger = logging.getLogger(__name__)


class Rendezvous:
    """How the workers of a group find each other (driver side).

    The default connects nothing: one worker, or workers that never talk (tests
    of the executor, local mode).

    Args:
        config: the backend's typed config (:class:`~polytrain.backends.core.backend.BackendConfig`).
    """

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def worker_env_vars(self) -> dict[str, str]:
        """Driver: environment variables every worker process must start with."""
        return {}

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: rendezvous, environment and process groups, once the workers run."""

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: release what :meth:`on_start` set up. Must tolerate dead workers."""

    def shutdown(self, group: WorkerGroup) -> None:
        """Driver: :meth:`on_shutdown`, never raising (a group with dead workers is shut down too)."""
        try:
            self.on_shutdown(group)
        except Exception:  # noqa: BLE001 - shutdown must go on with dead workers
            logger.debug("rendezvous on_shutdown failed", exc_info=True)
