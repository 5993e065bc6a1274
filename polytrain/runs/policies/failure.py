"""Which failures restart the worker group, and how often: a decision as data."""

from __future__ import annotations

import enum
import logging
import re

from polytrain.errors import WorkerDiedError, WorkerHangError

logger = logging.getLogger(__name__)


class FailureDecision(enum.Enum):
    """What the run loop does with a failed call."""

    #: Tear the group down, start a fresh one, restore the latest state, run the call again.
    RETRY = "retry"
    #: Raise the error; the run is over.
    RAISE = "raise"


class FailurePolicy:
    """Decides whether a failed call is retried on a fresh worker group.

    A lost worker (killed, out of memory, node gone: :class:`WorkerDiedError`)
    or a hung group (:class:`WorkerHangError`) is retried, up to ``max_retries``
    restarts over the run's life (3 by default, as in RaySGD), or as many
    restarts as a call allows itself. An exception raised by user code is never
    retried: it would fail the same way again. Nor is anything else
    (``KeyboardInterrupt``, a failed restart).

    Args:
        max_retries: restarts allowed over the run's life
            (:attr:`~polytrain.trainer_api.options.configs.FailureConfig.max_retries`).
        retryable: the errors a restart can cure (default :attr:`retryable`);
            ``polytrain launch`` retries any failed rank, as ``torchrun --max-restarts``.
        option: the option's name as the user set it, for the log line.
    """

    #: The errors a restart can cure.
    retryable: tuple[type[BaseException], ...] = (WorkerDiedError, WorkerHangError)

    def __init__(
        self,
        max_retries: int,
        retryable: tuple[type[BaseException], ...] | None = None,
        option: str = "failure_config max_retries",
    ) -> None:
        self.max_retries = max_retries
        self.num_restarts = 0
        self.option = option
        if retryable is not None:
            self.retryable = retryable

    def decide(
        self,
        error: BaseException,
        call_max_retries: int | None = None,
        call_restarts: int = 0,
    ) -> FailureDecision:
        """RETRY if ``error`` is retryable and the retry budget is not spent, else RAISE.

        The budget is ``max_retries`` restarts over the run's life, or, when a
        call sets its own (``train(max_retries=...)``, as in RaySGD),
        ``call_max_retries`` restarts of that call (``call_restarts`` so far).
        """
        if not isinstance(error, self.retryable):
            return FailureDecision.RAISE
        if call_max_retries is not None:
            spent = call_restarts >= call_max_retries
        else:
            spent = self.num_restarts >= self.max_retries
        return FailureDecision.RAISE if spent else FailureDecision.RETRY

    def should_retry(
        self,
        error: BaseException,
        call_max_retries: int | None = None,
        call_restarts: int = 0,
    ) -> bool:
        """True when :meth:`decide` says RETRY."""
        return self.decide(error, call_max_retries, call_restarts) is FailureDecision.RETRY

    def describe_limit(self) -> str:
        """``max_retries`` for a log line (``unlimited`` for Ray Train's ``max_failures=-1``)."""
        return "unlimited" if self.max_retries >= 2**31 - 1 else str(self.max_retries)

    def record_restart(
        self,
        error: BaseException,
        source: str | None = None,
        call_max_retries: int | None = None,
        call_restarts: int = 0,
    ) -> None:
        """Count a restart about to happen because of ``error``, and log it.

        ``source``: where the restarted group resumes from, for the log line; with a
        call's own budget (``call_max_retries``) the line counts that call's restarts.
        """
        self.num_restarts += 1
        if call_max_retries is None:
            count, limit, option = self.num_restarts, self.describe_limit(), self.option
        else:
            count, limit, option = (
                call_restarts + 1,
                str(call_max_retries),
                "this call's max_retries",
            )
        logger.warning(
            "%s; restart %d of %s (%s)%s.",
            describe_loss(error),
            count,
            limit,
            option,
            f" from {source}" if source else "",
        )


_DIED = re.compile(r"^Worker rank -?\d+ (?:\((?P<where>[^)]*)\) )?died: (?P<cause>.*)$")


def describe_loss(error: BaseException) -> str:
    """``Worker rank R died (pid P on IP: cause)``: one line for the log, from a failed call's error."""
    lines = str(error).splitlines()
    first = lines[0] if lines else type(error).__name__
    if not isinstance(error, WorkerDiedError | WorkerHangError):
        return first[:300]
    rank = getattr(error, "rank", "?")
    if isinstance(error, WorkerHangError):
        return f"Worker rank {rank} hung ({first[:300]})"
    match = _DIED.match(first)
    if match is None:
        return f"Worker rank {rank} died ({first[:300]})"
    where, cause = match.group("where"), match.group("cause")
    return f"Worker rank {rank} died ({f'{where}: ' if where else ''}{cause[:300]})"
