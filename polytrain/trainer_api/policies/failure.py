"""Which failures restart the worker group, and how often."""

from __future__ import annotations

import logging

from polytrain.errors import WorkerDiedError, WorkerHangError

logger = logging.getLogger(__name__)


class FailurePolicy:
    """Decides whether a failed call is retried on a fresh worker group.

    A lost worker (killed, out of memory, node gone: :class:`WorkerDiedError`)
    or a hung group (:class:`WorkerHangError`) is retried, up to ``max_retries``
    restarts over the trainer's life (3 by default, as in RaySGD), or as many
    restarts as a call allows itself. An exception raised by user code is never
    retried: it would fail the same way again. Nor is anything else
    (``KeyboardInterrupt``, a failed restart).

    Args:
        max_retries: restarts allowed over the trainer's life
            (:attr:`~polytrain.trainer_api.options.configs.FailureConfig.max_retries`).
    """

    #: The errors a restart can cure.
    retryable: tuple[type[BaseException], ...] = (WorkerDiedError, WorkerHangError)

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.num_restarts = 0

    def should_retry(
        self,
        error: BaseException,
        call_max_retries: int | None = None,
        call_restarts: int = 0,
    ) -> bool:
        """True if ``error`` is retryable and the retry budget is not spent.

        The budget is ``max_retries`` restarts over the trainer's life, or, when a
        call sets its own (``train(max_retries=...)``, as in RaySGD),
        ``call_max_retries`` restarts of that call (``call_restarts`` so far).
        """
        if not isinstance(error, self.retryable):
            return False
        if call_max_retries is not None:
            return call_restarts < call_max_retries
        return self.num_restarts < self.max_retries

    def record_restart(self, error: BaseException) -> None:
        """Count a restart about to happen because of ``error``, and log it."""
        self.num_restarts += 1
        logger.warning(
            "Restarting the worker group (restart %d; failure_config max_retries=%d) after: %s",
            self.num_restarts,
            self.max_retries,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
