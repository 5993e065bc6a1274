"""Which failures restart the worker group, and how often."""

from __future__ import annotations

import logging

from polytrain.errors import WorkerDiedError, WorkerHangError

logger = logging.getLogger(__name__)


class FailurePolicy:
    """Decides whether a failed call is retried on a fresh worker group.

    A lost worker (killed, out of memory, node gone: :class:`WorkerDiedError`)
    or a hung group (:class:`WorkerHangError`) is retried, up to ``max_retries``
    restarts over the trainer's life. An exception raised by user code is never
    retried: it would fail the same way again. Nor is anything else
    (``KeyboardInterrupt``, a failed restart).

    Args:
        max_retries: restarts allowed over the trainer's life
            (:attr:`~polytrain.trainer_api.config.FailureConfig.max_retries`).
    """

    #: The errors a restart can cure.
    retryable: tuple[type[BaseException], ...] = (WorkerDiedError, WorkerHangError)

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.num_restarts = 0

    def should_retry(self, error: BaseException) -> bool:
        """True if ``error`` is retryable and the retry budget is not spent."""
        return isinstance(error, self.retryable) and self.num_restarts < self.max_retries

    def record_restart(self, error: BaseException) -> None:
        """Count a restart about to happen because of ``error``, and log it."""
        self.num_restarts += 1
        logger.warning(
            "Restarting the worker group (restart %d of at most %d) after: %s",
            self.num_restarts,
            self.max_retries,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
