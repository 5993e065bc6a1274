"""Ray Train's ``ray.train.constants``: the names a Ray Train script reads, with polytrain's values.

Dataset keys, the default storage path and the environment variables a loop or a
test sets. The environment variables polytrain reads are listed in
:data:`HONOURED_ENV_VARS`; the others exist so that Ray Train code imports, and
setting them changes nothing (:data:`IGNORED_ENV_VARS` says why for each).
"""

from __future__ import annotations

import os
from pathlib import Path

from polytrain.train.config import DEFAULT_STORAGE_PATH as _DEFAULT_STORAGE_PATH

#: The dataset name Ray Train's trainers train on (``datasets={"train": ds}``).
TRAIN_DATASET_KEY = "train"
#: The dataset name of evaluation data.
EVALUATION_DATASET_KEY = "evaluation"
#: Ray AIR's checkpoint keys, kept for imports.
MODEL_KEY = "model"
PREPROCESSOR_KEY = "preprocessor"

#: Where runs go without ``RunConfig(storage_path=...)`` (expanded).
DEFAULT_STORAGE_PATH = Path(_DEFAULT_STORAGE_PATH).expanduser().as_posix()

#: ``report(checkpoint_dir_name=...)`` as a metrics key.
CHECKPOINT_DIR_NAME = "checkpoint_dir_name"
#: Auto-filled result keys of Ray Train 1.x (polytrain fills none of them).
TIME_TOTAL_S = "_time_total_s"
WORKER_HOSTNAME = "_hostname"
WORKER_NODE_IP = "_node_ip"
WORKER_PID = "_pid"
DETAILED_AUTOFILLED_KEYS = {WORKER_HOSTNAME, WORKER_NODE_IP, WORKER_PID, TIME_TOTAL_S}
RESULT_FILE_JSON = "results.json"
TRAIN_CHECKPOINT_SUBDIR = "checkpoints"
CHECKPOINT_METADATA_KEY = "checkpoint_metadata"
CHECKPOINT_RANK_KEY = "checkpoint_rank"

#: ``"1"`` (the default): every worker runs the loop in the run's working directory
#: below Ray's session directory (``<session>/artifacts/<run name>``), as in Ray Train;
#: ``"0"``: the worker's own working directory.
RAY_CHDIR_TO_TRIAL_DIR = "RAY_CHDIR_TO_TRIAL_DIR"
#: Ray Train's environment variables that polytrain does not read, and why.
IGNORED_ENV_VARS = {
    "TRAIN_RESULT_ENABLE_DETAILED_AUTOFILLED_METRICS": "no auto-filled metrics are added",
    "TRAIN_ENABLE_SHARE_CUDA_VISIBLE_DEVICES": (
        "each worker sees the GPUs Ray assigned it (ScalingConfig.num_gpus_per_worker)"
    ),
    "TRAIN_ENABLE_SHARE_HIP_VISIBLE_DEVICES": "no ROCm support",
    "TRAIN_ENABLE_SHARE_NEURON_CORES_ACCELERATOR": "no Neuron support",
    "TRAIN_ENABLE_SHARE_ASCEND_RT_VISIBLE_DEVICES": "no Ascend support",
    "TRAIN_PLACEMENT_GROUP_TIMEOUT_S": "use ScalingConfig(start_timeout_s=...)",
    "TRAIN_ENABLE_WORKER_SPREAD": "use ScalingConfig(placement_strategy='SPREAD')",
    "RAY_TRAIN_COUNT_PREEMPTION_AS_FAILURE": (
        "drains count in FailureConfig.max_preemption_failures, never in max_failures"
    ),
    "RAY_TRAIN_ENABLE_STATE_TRACKING": "no Ray dashboard state export",
    "TUNE_ONLY_STORE_CHECKPOINT_SCORE_ATTRIBUTE": "Tune gets every reported metric",
    "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "the backend's rendezvous tears the group down",
    "JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S": "no JAX backend",
}
COPY_DIRECTORY_CHECKPOINTS_INSTEAD_OF_MOVING_ENV = (
    "TRAIN_COPY_DIRECTORY_CHECKPOINTS_INSTEAD_OF_MOVING"  # polytrain always copies
)
TRAIN_ENABLE_WORKER_SPREAD_ENV = "TRAIN_ENABLE_WORKER_SPREAD"
TRAIN_PLACEMENT_GROUP_TIMEOUT_S_ENV = "TRAIN_PLACEMENT_GROUP_TIMEOUT_S"
ENABLE_DETAILED_AUTOFILLED_METRICS_ENV = "TRAIN_RESULT_ENABLE_DETAILED_AUTOFILLED_METRICS"
ENABLE_SHARE_CUDA_VISIBLE_DEVICES_ENV = "TRAIN_ENABLE_SHARE_CUDA_VISIBLE_DEVICES"
ENABLE_SHARE_HIP_VISIBLE_DEVICES_ENV = "TRAIN_ENABLE_SHARE_HIP_VISIBLE_DEVICES"
ENABLE_SHARE_NEURON_CORES_ACCELERATOR_ENV = "TRAIN_ENABLE_SHARE_NEURON_CORES_ACCELERATOR"
ENABLE_SHARE_NPU_RT_VISIBLE_DEVICES_ENV = "TRAIN_ENABLE_SHARE_ASCEND_RT_VISIBLE_DEVICES"
TUNE_ONLY_STORE_CHECKPOINT_SCORE_ATTRIBUTE = "TUNE_ONLY_STORE_CHECKPOINT_SCORE_ATTRIBUTE"
TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"
DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S = 30
JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S = "JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S"
DEFAULT_JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S = 30
TUNE_CHECKPOINT_ID = "_current_checkpoint_id"
#: Ray Train's migration warnings (polytrain refuses removed options with an error instead).
ENABLE_V2_MIGRATION_WARNINGS_ENV_VAR = "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS"
V2_MIGRATION_GUIDE_LINK_MESSAGE = (
    "See this issue for more context and migration options: "
    "https://github.com/ray-project/ray/issues/49454."
)
V2_MIGRATION_GUIDE_MESSAGE = V2_MIGRATION_GUIDE_LINK_MESSAGE
_DEPRECATED_VALUE = "DEPRECATED"
RAY_TRAIN_COUNT_PREEMPTION_AS_FAILURE = "RAY_TRAIN_COUNT_PREEMPTION_AS_FAILURE"
RAY_TRAIN_ENABLE_STATE_TRACKING = "RAY_TRAIN_ENABLE_STATE_TRACKING"
#: The environment variables polytrain reads.
HONOURED_ENV_VARS = (RAY_CHDIR_TO_TRIAL_DIR,)
TRAIN_ENV_VARS = {RAY_CHDIR_TO_TRIAL_DIR, *IGNORED_ENV_VARS}


def chdir_to_trial_dir() -> bool:
    """Whether workers run in the run's working directory (``RAY_CHDIR_TO_TRIAL_DIR``, default on)."""
    return os.environ.get(RAY_CHDIR_TO_TRIAL_DIR, "1").strip().lower() not in ("0", "false", "")


def _get_ray_train_session_dir() -> str:
    """``<Ray session directory>/artifacts``: where workers' working directories go (Ray Train's).

    Raises:
        RuntimeError: Ray is not initialised in this process.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray must be initialized to get the session dir.")
    node = ray._private.worker._global_node
    return Path(node.get_session_dir_path(), "artifacts").as_posix()
