"""DeepSpeed's effects on the process it runs in, kept in check (both sides of the backend).

``import deepspeed`` and its engine change the environment and cache process
groups in module globals; the driver (and a local-mode worker, which is the
driver) keeps its environment, and a later trainer in the same process must not
reuse the groups of a destroyed world. No framework is imported at module level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def preserved_env() -> Iterator[None]:
    """Undo the environment changes DeepSpeed and torch make for themselves on import/init.

    ``import deepspeed`` sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` and its engine's first
    use imports torch's inductor, which sets ``TORCHINDUCTOR_CACHE_DIR``; the driver
    (and a local-mode worker, which is the driver) keeps its environment.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def mlflow_hidden() -> Iterator[None]:
    """Make ``import mlflow`` fail inside the block, unless mlflow is imported already.

    ``deepspeed.autotuning.autotuner`` imports mlflow at DeepSpeed's import when it is
    installed (it is, with the trackers extra): 1.8 s of a 2.5 s ``import deepspeed``,
    for an autotuner that training never runs. A ``None`` entry in ``sys.modules`` is
    Python's documented way to make an import raise ImportError, which the autotuner
    catches; the entry is removed afterwards, so user code imports mlflow as usual.
    """
    if "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def import_deepspeed() -> Any:
    """Import DeepSpeed without its import-time environment changes or its mlflow import."""
    with preserved_env(), mlflow_hidden():
        import deepspeed
    return deepspeed


def skip_unused_shm_extension() -> None:
    """Do not build DeepSpeed's shared-memory all-reduce extension on CPU.

    DeepSpeed compiles it on the first launch on a machine (40-120 s), but uses it
    only for inference all-reduce and only when LOCAL_SIZE is set; training never
    calls it. Gloo does the training collectives either way.
    """
    if "LOCAL_SIZE" in os.environ:
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:  # noqa: BLE001 - a DeepSpeed without the op table just builds it
        logger.debug("could not mark deepspeed_shm_comm as unused", exc_info=True)


_AUTOTP_GLOBALS = (
    "mpu",
    "mesh_device",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
)


def forget_deepspeed_groups() -> None:
    """Drop DeepSpeed's cached process groups before the default group is destroyed.

    DeepSpeed caches sub-groups in module globals; a later trainer in the same
    process (local mode) would otherwise reuse groups of a destroyed world.
    """
    try:
        from deepspeed.utils import groups
    except Exception:  # noqa: BLE001 - nothing cached without DeepSpeed
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, name, None if not isinstance(value, dict) else {})
    # An AutoTP engine also records its mesh and its groups module as the "mpu": a later
    # engine in this worker would ask them for its data-parallel group.
    for name in _AUTOTP_GLOBALS:
        if hasattr(groups, name):
            setattr(groups, name, None)
