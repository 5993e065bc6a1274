"""polytrain: one trainer API, every distributed backend.

The public names are imported lazily, so ``import polytrain`` costs almost
nothing until a trainer is used, and never imports an optional framework.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "TorchTrainer": "polytrain.trainer_api.torch.trainer",
    "TFTrainer": "polytrain.trainer_api.tensorflow.trainer",
    "load_config": "polytrain.trainer_api.options.run_config",
    "TrainingOperator": "polytrain.trainer_api.torch.operator",
    "ScalingConfig": "polytrain.trainer_api.options.configs",
    "FailureConfig": "polytrain.trainer_api.options.configs",
    "CheckpointConfig": "polytrain.trainer_api.options.configs",
    "available_backends": "polytrain.backends.registry",
    "describe_backends": "polytrain.backends.registry",
    "get_backend": "polytrain.backends.registry",
    "load_checkpoint": "polytrain.checkpoint.single_file",
}

#: Submodules reachable as attributes without an explicit import (``polytrain.pool.configure``).
_SUBMODULES = ("pool",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

if TYPE_CHECKING:  # pragma: no cover
    from polytrain.backends.registry import available_backends, describe_backends, get_backend
    from polytrain.checkpoint.single_file import load_checkpoint
    from polytrain.trainer_api.options.configs import CheckpointConfig, FailureConfig, ScalingConfig
    from polytrain.trainer_api.options.run_config import load_config
    from polytrain.trainer_api.tensorflow.trainer import TFTrainer
    from polytrain.trainer_api.torch.operator import TrainingOperator
    from polytrain.trainer_api.torch.trainer import TorchTrainer


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"polytrain.{name}")
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'polytrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
