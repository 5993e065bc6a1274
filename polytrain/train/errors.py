"""Ray Train's errors: what ``fit()`` raises when a run fails (``TrainingFailedError`` and its kinds).

Ray Train 2.x raises :class:`WorkerGroupError` when workers failed (an exception in
the loop, a lost or hung worker, retries spent) and :class:`ControllerError` when the
driver side failed (placement, storage, a callback). polytrain's ``fit()`` raises the
same classes, and keeps polytrain's information: the error is **also** an instance
of the class polytrain raised before (:class:`~polytrain.errors.WorkerError` with its
``rank`` and ``remote_traceback``, :class:`~polytrain.errors.WorkerDiedError`,
:class:`~polytrain.errors.WorkerHangError`, :class:`~polytrain.errors.InsufficientResourcesError`,
...) and of the user's own exception class where Python can combine them, so
``except TrainingFailedError``, ``except WorkerError`` and ``except ValueError`` all
catch a ``ValueError`` raised in a worker. Mistakes in the trainer's own arguments
(:class:`~polytrain.errors.ConfigError`, a missing framework) are raised as they are,
as Ray raises them from the constructor.
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import (
    ConfigError,
    MissingDependencyError,
    PolytrainError,
    PreemptedError,
    WorkerError,
)

__all__ = [
    "ControllerError",
    "DeprecatedOptionError",
    "NCCLHangError",
    "PreemptionError",
    "TrainingFailedError",
    "WorkerGroupError",
    "as_training_failed",
]


class TrainingFailedError(PolytrainError, RuntimeError):
    """``fit()`` failed: a :class:`WorkerGroupError` or a :class:`ControllerError` (Ray Train's)."""


class WorkerGroupError(TrainingFailedError):
    """Workers failed during training (Ray Train's ``WorkerGroupError``).

    Args:
        error_message: what happened, in words.
        worker_failures: world rank -> the exception of that worker.

    Attributes:
        worker_failures: world rank -> exception (the exceptions carry polytrain's
            ``rank`` and ``remote_traceback`` when they are
            :class:`~polytrain.errors.WorkerError`\\ s).
    """

    def __init__(self, error_message: str, worker_failures: dict[int, BaseException]) -> None:
        # Not super(): combined with a polytrain error, the next __init__ takes other arguments.
        Exception.__init__(self, "Training failed due to worker errors:\n" + error_message)
        self._error_message = error_message
        self.worker_failures = dict(worker_failures)

    def __reduce__(self) -> tuple:
        return (type(self), (self._error_message, self.worker_failures))


class NCCLHangError(WorkerGroupError):
    """A hung collective (Ray Train's NCCL RAS detection).

    polytrain's hang watchdog (``FailureConfig.hang_timeout_s``) raises a
    :class:`WorkerGroupError` that is also a :class:`~polytrain.errors.WorkerHangError`
    instead; this class exists so that ``except NCCLHangError`` in Ray Train code imports.
    """


class ControllerError(TrainingFailedError):
    """The driver side of the run failed (Ray Train's ``ControllerError``).

    Args:
        controller_failure: the exception raised on the driver.
    """

    def __init__(self, controller_failure: BaseException) -> None:
        Exception.__init__(
            self, "Training failed due to controller error:\n" + str(controller_failure)
        )
        self.controller_failure = controller_failure
        self.with_traceback(controller_failure.__traceback__)

    def __reduce__(self) -> tuple:
        return (type(self), (self.controller_failure,))


class PreemptionError(TrainingFailedError):
    """More drained nodes than ``FailureConfig.max_preemption_failures`` allows (Ray Train's).

    Args:
        preemption_info: the drain that ended the run (a
            :class:`~polytrain.train.PreemptionInfo`), or None when unknown.
        drain_timed_out: Ray Train's flag; polytrain stops the group itself at the
            loop's checkpoint, so it is False unless given.
        message: the text (default: Ray's wording with the preempted ranks).
    """

    def __init__(
        self, preemption_info: Any = None, drain_timed_out: bool = False, message: str | None = None
    ) -> None:
        self.preemption_info = preemption_info
        self.drain_timed_out = drain_timed_out
        ranks = getattr(preemption_info, "preempted_ranks", None)
        Exception.__init__(
            self,
            message
            or (
                f"Training was interrupted by node preemption (preempted_ranks={ranks}, "
                f"drain_timed_out={drain_timed_out})."
            ),
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.preemption_info, self.drain_timed_out, str(self)))


class DeprecatedOptionError(ConfigError, DeprecationWarning):
    """An option Ray Train 2.x removed (it raises ``DeprecationWarning`` for it); says what to use instead."""


# ------------------------------------------------------------ conversion
_COMBINED: dict[tuple[type, type], type] = {}


def _combined(kind: type, original: type) -> type:
    """A class that is both ``kind`` (a Ray Train error) and ``original``, where Python allows it."""
    if issubclass(original, kind):
        return original
    key = (kind, original)
    if key not in _COMBINED:
        try:
            combined = type(
                f"{kind.__name__}[{original.__name__}]",
                (kind, original),
                {"__module__": __name__, "__reduce__": _reduce_combined, "__str__": _str},
            )
            combined.__new__(combined)  # probes the instance lay-out (OSError's is its own)
        except TypeError:
            combined = kind
        _COMBINED[key] = combined
    return _COMBINED[key]


def _str(self: BaseException) -> str:
    # KeyError and friends quote their message; keep the Ray Train error's text.
    return str(self.args[0]) if self.args else ""


def _reduce_combined(self: BaseException) -> tuple:
    # By the original error (it pickles itself), not by the generated class (not importable).
    kind = next(c for c in type(self).__mro__ if c in _KINDS)
    return (_rebuild, (kind, self.__dict__["_original"], self.args, dict(self.__dict__)))


def _rebuild(
    kind: type, original: BaseException, args: tuple, state: dict[str, Any]
) -> BaseException:
    cls = _combined(kind, type(original))
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def _make(kind: type, original: BaseException, ray_args: tuple) -> TrainingFailedError:
    cls = _combined(kind, type(original))
    error = cls.__new__(cls)
    kind.__init__(error, *ray_args)
    error.__dict__["_original"] = original
    # The original's own attributes (rank, remote_traceback, checkpoint_path, ...).
    for name, value in vars(original).items():
        error.__dict__.setdefault(name, value)
    return error


def as_training_failed(error: BaseException, preemption_info: Any = None) -> BaseException:
    """The error ``fit()`` raises for ``error`` (raised by polytrain's run): Ray Train's kind of it.

    * a worker failed (:class:`~polytrain.errors.WorkerError` and its kinds): a
      :class:`WorkerGroupError` (a :class:`NCCLHangError` never: a hang is a
      :class:`WorkerGroupError` that is also a :class:`~polytrain.errors.WorkerHangError`);
    * too many drained nodes (:class:`~polytrain.errors.PreemptedError`): a :class:`PreemptionError`;
    * a mistake in the trainer's arguments (:class:`~polytrain.errors.ConfigError`,
      :class:`~polytrain.errors.MissingDependencyError`), ``KeyboardInterrupt`` and other
      ``BaseException``\\ s that are not ``Exception``\\ s: unchanged;
    * anything else on the driver: a :class:`ControllerError`.

    Each result is also an instance of ``error``'s class where Python can combine the
    two, with ``error``'s attributes.
    """
    if isinstance(error, TrainingFailedError) or not isinstance(error, Exception):
        return error
    if isinstance(error, (ConfigError, MissingDependencyError)):
        return error
    if isinstance(error, WorkerError):
        text = str(error)
        return _make(WorkerGroupError, error, (text, {error.rank: error}))
    if isinstance(error, PreemptedError):
        return _make(PreemptionError, error, (preemption_info, False, str(error)))
    return _make(ControllerError, error, (error,))


_KINDS = (WorkerGroupError, ControllerError, PreemptionError)
