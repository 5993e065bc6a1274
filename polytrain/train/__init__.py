"""``polytrain.train``: Ray Train's function API on polytrain's backends.

A Ray Train script changes its imports (``ray.train`` -> ``polytrain.train``) and
runs on ddp, horovod, fairscale, fsdp or deepspeed workers with polytrain's
restarts, warm pool and hang watchdog. Inside ``train_loop_per_worker``:
:func:`report`, :func:`get_checkpoint`, :func:`get_context`,
:func:`get_dataset_shard`, :func:`get_preemption_info` (a node of the group drains:
:class:`PreemptionInfo`); around it: :class:`ScalingConfig`, :class:`RunConfig`,
:class:`FailureConfig`, :class:`CheckpointConfig`, :class:`Checkpoint`,
:class:`Result`. The trainers live in :mod:`polytrain.train.torch`,
:mod:`polytrain.train.horovod` and :mod:`polytrain.train.tensorflow`.
"""

from __future__ import annotations

from polytrain.train.checkpoint import Checkpoint
from polytrain.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from polytrain.train.preemption import PreemptionInfo
from polytrain.train.result import Result
from polytrain.train.session import (
    SessionMisuseError,
    TrainContext,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    get_preemption_info,
    report,
)

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "PreemptionInfo",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SessionMisuseError",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
]
