"""What ``report`` takes besides metrics, and what :func:`get_all_reported_checkpoints` returns (Ray Train's).

:class:`CheckpointUploadMode` says how a reported checkpoint reaches the run's
storage, :class:`CheckpointConsistencyMode` what
:func:`~polytrain.train.get_all_reported_checkpoints` waits for, and a
:class:`ReportedCheckpoint` is one kept checkpoint with its metrics and its
validation status (:class:`ReportedCheckpointStatus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from polytrain.train.checkpoint import Checkpoint

__all__ = [
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
]


class CheckpointUploadMode(Enum):
    """How ``report(checkpoint=...)`` stores the checkpoint (Ray Train's).

    Members:
        SYNC: copy the files into the run's storage before ``report`` returns (default).
        ASYNC: copy them in a background thread of the worker; ``report`` returns at
            once, reports stay in order, and the local directory is deleted after the
            copy unless ``delete_local_checkpoint_after_upload=False``. Do not report a
            directory that is deleted when ``report`` returns (a
            ``TemporaryDirectory`` block) in this mode.
        NO_UPLOAD: the checkpoint is already in the run's storage (written there by
            the loop, e.g. below ``get_context().get_storage()``); it is registered as
            it is.
    """

    ASYNC = "ASYNC"
    SYNC = "SYNC"
    NO_UPLOAD = "NO_UPLOAD"

    def default_delete_local_checkpoint_after_upload(self) -> bool:
        """Whether the local directory goes after the copy when the caller does not say (ASYNC: yes)."""
        return self == CheckpointUploadMode.ASYNC


class CheckpointConsistencyMode(Enum):
    """What :func:`~polytrain.train.get_all_reported_checkpoints` waits for (Ray Train's).

    Members:
        COMMITTED: every report this worker made so far is committed.
        VALIDATED: and every validation of those checkpoints has finished.
    """

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(Enum):
    """Where a kept checkpoint stands (Ray Train's).

    Members:
        COMMITTED: saved; no validation was asked for.
        PENDING_VALIDATION: saved; its validation is queued or running.
        VALIDATED: saved and validated (its metrics include the validation's).
        VALIDATION_TIMEOUT: its validation ran past ``ValidationTaskConfig.timeout_s``.
        VALIDATION_FAILED: its validation function raised.
    """

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"
    VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"
    VALIDATION_FAILED = "VALIDATION_FAILED"


@dataclass
class ReportedCheckpoint:
    """A kept checkpoint, the metrics reported with it (and its validation's), its status.

    Attributes:
        checkpoint: the committed checkpoint.
        metrics: rank 0's metrics of that report, updated with the validation's.
        status: a :class:`ReportedCheckpointStatus`.
    """

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus
