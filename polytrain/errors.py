"""The exceptions polytrain raises. Imports nothing, so every layer can use them."""

from __future__ import annotations


class PolytrainError(Exception):
    """Base class of polytrain's own errors."""


class WorkerError(PolytrainError, RuntimeError):
    """A worker raised: carries its rank and the remote traceback.

    Attributes:
        rank: the world rank of the worker that failed first.
        remote_traceback: the traceback text from the worker process.
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        # copy.copy and pickle (Ray Tune copies a trial's error) must keep rank and traceback.
        return (type(self), (self.args[0], self.rank, self.remote_traceback))


_LIKE: dict[type, type] = {}


def worker_error_like(
    cause: BaseException, message: str, rank: int, remote_traceback: str = ""
) -> WorkerError:
    """A :class:`WorkerError` that is also an instance of ``cause``'s class, where Python allows it.

    ``except ValueError`` and ``pytest.raises(ValueError)`` then catch a ``ValueError``
    raised in a worker, as they catch Ray's own task errors, while the error still
    carries the rank and the remote traceback. Classes that cannot be combined (an
    incompatible instance layout such as ``OSError``'s, ``KeyboardInterrupt``) give a
    plain :class:`WorkerError`.
    """
    return _rebuild_like(type(cause), message, rank, remote_traceback)


def _combined_class(cause_cls: type) -> type:
    if not issubclass(cause_cls, Exception) or issubclass(cause_cls, WorkerError):
        return WorkerError
    if cause_cls not in _LIKE:
        try:
            combined = type(
                f"WorkerError[{cause_cls.__name__}]",
                (WorkerError, cause_cls),
                {"__reduce__": _reduce_like, "__module__": __name__, "__str__": _str_like},
            )
            combined.__new__(combined, "probe")
        except TypeError:  # instance lay-out conflict (OSError), a final class, a metaclass clash
            combined = WorkerError
        _LIKE[cause_cls] = combined
    return _LIKE[cause_cls]


def _reduce_like(self: WorkerError) -> tuple:
    # Pickle by the user's class (importable), not the generated one.
    user_cls = next(c for c in type(self).__bases__ if c is not WorkerError)
    return (_rebuild_like, (user_cls, self.args[0], self.rank, self.remote_traceback))


def _str_like(self: WorkerError) -> str:
    # KeyError and friends format their message differently; keep WorkerError's text.
    return str(self.args[0]) if self.args else ""


def _rebuild_like(cause_cls: type, message: str, rank: int, remote_traceback: str) -> WorkerError:
    cls = _combined_class(cause_cls)
    error = cls.__new__(cls, message)
    WorkerError.__init__(error, message, rank, remote_traceback)
    return error


class WorkerDiedError(WorkerError):
    """A worker process died (killed, out of memory, node lost) instead of raising."""


class WorkerHangError(WorkerError):
    """No worker made progress for ``hang_timeout_s``; carries every worker's stack."""


class InsufficientResourcesError(PolytrainError, RuntimeError):
    """The cluster cannot place the requested workers within ``start_timeout_s``."""


class TrainerShutdownError(PolytrainError, RuntimeError):
    """A call on a trainer after :meth:`shutdown`."""


class CheckpointError(PolytrainError, ValueError):
    """A checkpoint file that cannot be read, or is not a polytrain checkpoint."""


class CreatorError(PolytrainError, ValueError):
    """A creator that built something the trainer cannot use (a ``ValueError``).

    For example several models where the default step trains one (RaySGD raised
    ``ValueError`` there), an empty loader, a data pair of three items, an uncompiled
    Keras model. :class:`CreatorTypeError` is the ``TypeError`` kind.
    """


class CreatorTypeError(CreatorError, TypeError):
    """A creator that is not callable, takes the wrong arguments or returns the wrong type.

    Also a ``TypeError``, the exception Python raises for a call with the wrong arguments.
    """


class ConfigError(PolytrainError, ValueError):
    """A trainer option or config file value that is not allowed."""


class ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type, or an unknown option name.

    Also a ``TypeError``, the exception Python raises for an unexpected keyword.
    """


class UnknownBackendError(ConfigError):
    """A backend name that is neither a registered name nor an alias."""


class MissingDependencyError(PolytrainError, ImportError):
    """An optional framework that a requested feature needs is not installed."""


class RunStoppedError(PolytrainError, RuntimeError):
    """The run stopped before its end, from outside, and can continue from a checkpoint.

    The base of :class:`TerminatedError` (the driver's termination signal) and
    :class:`DrainLimitError` (more drains than the drain limit allows).
    ``PreemptedError`` is its former name, still importable and caught the same way.

    Attributes:
        checkpoint_path: the committed checkpoint to resume from (None if its write failed).
        signal_number: the signal received (15 unless a termination signal says otherwise).
        exit_code: the exit status a script should end with: 143 (128 + SIGTERM), what
            ``polytrain train`` returns, so that a scheduler requeues the job.
    """

    exit_code = 143

    def __init__(
        self, message: str, checkpoint_path: str | None = None, signal_number: int = 15
    ) -> None:
        super().__init__(message)
        self.checkpoint_path = checkpoint_path
        self.signal_number = signal_number


class TerminatedError(RunStoppedError):
    """Training stopped on the driver's termination signal (SIGTERM: a Slurm time limit, a pod eviction).

    Raised by ``train()`` once the workers' checkpoint at the stop (the data position
    and random states) is committed and the trainer is shut down; the same script
    with ``resume=True`` (``polytrain train --resume``) continues with no step lost.
    """


class DrainLimitError(RunStoppedError):
    """A node of the group drained once more than the drain limit allows.

    The group still stopped at a step and checkpointed there (``checkpoint_path``);
    the run is stopped instead of moving off the node. Raise the limit
    (``failure_config max_drains``, a strategy's ``max_drains``, Ray Train's
    ``max_preemption_failures``) or resume from the checkpoint.
    """


#: The former name of :class:`RunStoppedError` (catches both kinds of stop); kept so that
#: existing ``except PreemptedError`` code keeps working.
PreemptedError = RunStoppedError
