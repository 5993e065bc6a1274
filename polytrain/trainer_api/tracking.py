"""The trainers' side of experiment tracking: hand the driver's reduced metrics to the loggers.

The loggers themselves live in :mod:`polytrain.loggers` (``LoggerSet``,
``resolve_loggers``); this module only calls them, at the moments the trainers
define: ``start`` before the first logged call, ``log_metrics`` after every
``train()`` / ``validate()`` with the metrics reduced over the workers, and
``finish`` at ``shutdown()``. Without ``loggers`` nothing is imported.
"""

from __future__ import annotations

import numbers
from typing import Any

from polytrain.errors import ConfigError


class TrainerLoggers:
    """The loggers of one trainer (a no-op without any).

    Args:
        loggers: ``None``, or Logger instances and names ("tensorboard", "mlflow",
            "wandb", "csv"), resolved by ``polytrain.loggers.resolve_loggers``.
        log_dir: where loggers given by name write (None: ``polytrain.loggers``'s
            default, ``polytrain_runs/run-<time>``).

    Raises:
        ConfigError: loggers given but :mod:`polytrain.loggers` is not available, or
            a value it rejects.
    """

    def __init__(self, loggers: Any, log_dir: str | None) -> None:
        self._set: Any = None
        self._started = False
        if loggers is None:
            return
        try:
            from polytrain.loggers import LoggerSet, resolve_loggers
        except ImportError as exc:
            raise ConfigError(
                f"loggers={loggers!r} needs the polytrain.loggers package, which this "
                f"installation lacks ({exc}). Upgrade polytrain, or drop loggers=."
            ) from exc
        self._set = LoggerSet(resolve_loggers(loggers, log_dir))

    def log(
        self, prefix: str, metrics: dict[str, Any], step: int, epoch: int, run_info: Any
    ) -> None:
        """Log the numeric ``metrics`` of a call (``prefix`` "train" or "val"); start the run first.

        ``run_info`` is a callable returning the run's description (hyperparameters,
        backend, workers, framework), called once.
        """
        if self._set is None:
            return
        if not self._started:
            self._set.start(run_info())
            self._started = True
        numeric = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool)
        }
        self._set.log_metrics(numeric, step=step, epoch=epoch, prefix=prefix)

    def finish(self) -> None:
        """End the run in every logger (once; nothing if it never started)."""
        if self._set is not None and self._started:
            self._started = False
            self._set.finish()
