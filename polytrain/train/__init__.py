"""``polytrain.train``: Ray Train's function API on polytrain's backends.

A Ray Train script changes its imports (``ray.train`` -> ``polytrain.train``) and
runs on ddp, horovod, fairscale, fsdp or deepspeed workers with polytrain's
restarts, warm pool and hang watchdog. Every public name of Ray Train 2.x's
``ray.train`` is here (the migration guide lists each with its status). Inside
``train_loop_per_worker``: :func:`report`, :func:`get_checkpoint`,
:func:`get_all_reported_checkpoints`, :func:`get_context`, :func:`get_dataset_shard`,
:func:`get_preemption_info`, and :mod:`polytrain.train.collective`; around it:
:class:`ScalingConfig`, :class:`RunConfig`, :class:`FailureConfig`,
:class:`CheckpointConfig`, :class:`DataConfig`, :class:`ValidationConfig`,
:class:`UserCallback`, :class:`Checkpoint`, :class:`Result` and the errors ``fit()``
raises (:class:`TrainingFailedError`). The trainers live in
:mod:`polytrain.train.torch`, :mod:`polytrain.train.horovod` and
:mod:`polytrain.train.tensorflow`; Lightning's names in :mod:`polytrain.train.lightning`.
"""

from __future__ import annotations

from polytrain.train.backend import BackendConfig
from polytrain.train.callbacks import UserCallback
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.config import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    SyncConfig,
)
from polytrain.train.constants import TRAIN_DATASET_KEY
from polytrain.train.errors import (
    ControllerError,
    NCCLHangError,
    PreemptionError,
    TrainingFailedError,
    WorkerGroupError,
)
from polytrain.train.preemption import PreemptionInfo
from polytrain.train.reporting import (
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
)
from polytrain.train.result import Result
from polytrain.train.session import (
    SessionMisuseError,
    TrainContext,
    get_all_reported_checkpoints,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    get_preemption_info,
    report,
)
from polytrain.train.trainer import DataParallelTrainer
from polytrain.train.validation import ValidationConfig, ValidationFn, ValidationTaskConfig

__all__ = [
    "TRAIN_DATASET_KEY",
    "BackendConfig",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ControllerError",
    "DataConfig",
    "DataParallelTrainer",
    "FailureConfig",
    "LoggingConfig",
    "NCCLHangError",
    "PreemptionError",
    "PreemptionInfo",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SessionMisuseError",
    "SyncConfig",
    "TrainContext",
    "TrainingFailedError",
    "UserCallback",
    "ValidationConfig",
    "ValidationFn",
    "ValidationTaskConfig",
    "WorkerGroupError",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
]
