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


class CreatorError(PolytrainError, TypeError):
    """A creator function that is not callable, takes the wrong arguments or returns the wrong type."""


class ConfigError(PolytrainError, ValueError):
    """A trainer option or config file value that is not allowed."""
