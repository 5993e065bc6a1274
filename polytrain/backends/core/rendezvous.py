"""The driver side of a backend: connect a started worker group, and release it.

Like Ray Train's ``Backend``: driver hooks only, and no framework imported here.
A rendezvous sends module-level functions to the workers (through the
:class:`~polytrain.launchers.base.WorkerGroup` contract); those functions import
their framework inside the worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from polytrain.errors import ConfigError

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

    def worker_process_env(self) -> dict[str, str]:
        """Driver: variables read only when a process starts, so set before it starts.

        Unlike :meth:`worker_env_vars` (set in the running worker), these reach the
        worker processes through Ray's ``runtime_env`` (see
        :mod:`polytrain.launchers.process_env`); the user's own values win. Default: none.
        """
        return {}

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: rendezvous, environment and process groups, once the workers run."""

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: release what :meth:`on_start` set up. Must tolerate dead workers."""

    def refuse_torchrun(self, group: WorkerGroup, backend: str, instead: str) -> None:
        """Driver: refuse local mode under torchrun for a backend with a rendezvous of its own.

        Local mode in a process torchrun started joins torchrun's process group
        (:mod:`polytrain.launchers.torchrun`); a backend whose workers meet another way
        (Horovod's rendezvous server, TensorFlow's ``TF_CONFIG``) cannot join it.

        Raises:
            ConfigError: ``group`` runs under torchrun.
        """
        world = getattr(group, "torchrun", None)
        if world is None:
            return
        raise ConfigError(
            f"backend {backend!r} cannot run in local mode (num_workers=0) under torchrun "
            f"(this process is {world.describe()}): its workers do not meet through torchrun's "
            f"process group. {instead}"
        )

    def shutdown(self, group: WorkerGroup) -> None:
        """Driver: :meth:`on_shutdown`, never raising (a group with dead workers is shut down too)."""
        try:
            self.on_shutdown(group)
        except Exception:  # noqa: BLE001 - shutdown must go on with dead workers
            logger.debug("rendezvous on_shutdown failed", exc_info=True)
