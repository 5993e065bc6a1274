"""Experiment tracking: TensorBoard, MLflow, Weights & Biases, CSV, or your own :class:`Logger`.

Trainers take ``loggers=[...]`` (names or instances) and drive a
:class:`LoggerSet` from the driver: hyperparameters once per run, then the
metrics reduced over the workers after every ``train()`` and ``validate()``::

    from polytrain.loggers import CSVLogger, LoggerSet, MLflowLogger

    loggers = LoggerSet(["tensorboard", MLflowLogger(tracking_uri="http://mlflow:5000")],
                        log_dir="runs/exp1")
    loggers.start({"config": {"lr": 0.1}, "backend": "ddp", "num_workers": 2,
                   "framework": "torch"})
    loggers.log_metrics({"loss": 0.42}, step=100, epoch=0, prefix="train")
    loggers.finish()

Importing this package imports no tracking library.
"""

from __future__ import annotations

from typing import Any

from polytrain.compat.imports import register_install_hint
from polytrain.loggers.base import (
    Logger,
    LoggerError,
    default_log_dir,
    flatten_params,
    scalar_metrics,
)
from polytrain.loggers.logger_set import LOGGER_NAMES, LoggerSet, resolve_loggers

for _module in ("tensorboard", "tensorboardX", "mlflow", "wandb"):
    register_install_hint(_module, 'pip install "polytrain[trackers]"')

__all__ = [
    "LOGGER_NAMES",
    "CSVLogger",
    "Logger",
    "LoggerError",
    "LoggerSet",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "default_log_dir",
    "flatten_params",
    "resolve_loggers",
    "scalar_metrics",
]

_LAZY = {
    "CSVLogger": "polytrain.loggers.csv_logger",
    "TensorBoardLogger": "polytrain.loggers.tensorboard_logger",
    "MLflowLogger": "polytrain.loggers.mlflow_logger",
    "WandbLogger": "polytrain.loggers.wandb_logger",
}


def __getattr__(name: str) -> Any:
    # The built-in loggers' modules are small, but keep `import polytrain.loggers` minimal.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polytrain.loggers' has no attribute {name!r}")
