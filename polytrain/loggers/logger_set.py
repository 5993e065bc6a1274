"""The loggers of one trainer: ``loggers=["tensorboard", "csv", my_logger]`` resolved and driven together.

Names go through a name table over the built-in loggers, each imported only when
its name is used; :mod:`polytrain.loggers.base` (the interface) imports none of them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError, PolytrainError
from polytrain.loggers.base import Logger, LoggerError, default_log_dir


# ----------------------------------------------------------------- resolution
def _builtin(name: str, log_dir: Path) -> Logger:
    if name == "csv":
        from polytrain.loggers.csv_logger import CSVLogger

        return CSVLogger(log_dir)
    if name == "tensorboard":
        from polytrain.loggers.tensorboard_logger import TensorBoardLogger

        return TensorBoardLogger(log_dir)
    if name == "mlflow":
        from polytrain.loggers.mlflow_logger import MLflowLogger

        return MLflowLogger(save_dir=log_dir)
    from polytrain.loggers.wandb_logger import WandbLogger

    return WandbLogger(save_dir=log_dir)


#: The names :func:`resolve_loggers` knows.
LOGGER_NAMES = ("tensorboard", "mlflow", "wandb", "csv")


def _items(value: Any) -> list[Any]:
    if value is None or value is False:
        return []
    if isinstance(value, (str, Logger)):
        value = [value]
    if isinstance(value, LoggerSet):
        return list(value.loggers)
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise ConfigTypeError(
            f"loggers must be a list of Logger instances or names ({', '.join(LOGGER_NAMES)}), "
            f"or a comma-separated string of names; got {type(value).__name__}: {value!r}."
        )
    items: list[Any] = []
    for item in value:
        if isinstance(item, str):
            items += [part.strip().lower() for part in item.split(",") if part.strip()]
        else:
            items.append(item)
    return items


def resolve_loggers(value: Any, log_dir: str | Path | None = None) -> list[Logger]:
    """Turn ``loggers=`` into Logger instances; names become built-in loggers writing to ``log_dir``.

    Args:
        value: None, a Logger, a name, ``"tensorboard,csv"``, or a list of names and
            Logger instances (also a :class:`LoggerSet`).
        log_dir: the directory named loggers write into (TensorBoard in
            ``log_dir/tensorboard``, MLflow in ``log_dir/mlflow.db``, W&B in
            ``log_dir/wandb``, CSV in ``log_dir/metrics.csv``); default
            :func:`default_log_dir`. Created when a named logger needs it.

    Raises:
        ConfigError: an unknown or repeated name (the message lists the valid ones).
        ConfigTypeError: something that is neither a name nor a Logger.
        MissingDependencyError: a named logger whose library is not installed.
    """
    items = _items(value)
    resolved: list[Logger] = []
    names = [item for item in items if isinstance(item, str)]
    for name in names:
        if name not in LOGGER_NAMES:
            close = difflib.get_close_matches(name, LOGGER_NAMES, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"Unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)} or pass a "
                f"polytrain.loggers.Logger instance.{hint}"
            )
        if names.count(name) > 1:
            raise ConfigError(f"Logger {name!r} is given more than once in loggers={value!r}.")
    directory = Path(log_dir) if log_dir is not None else None
    for item in items:
        if isinstance(item, Logger):
            resolved.append(item)
        elif isinstance(item, str):
            directory = directory or default_log_dir()
            resolved.append(_builtin(item, directory))
        else:
            raise ConfigTypeError(
                f"loggers: {item!r} ({type(item).__name__}) is neither a logger name "
                f"({', '.join(LOGGER_NAMES)}) nor a polytrain.loggers.Logger instance."
            )
    return resolved


# -------------------------------------------------------------------- the set
class LoggerSet:
    """The loggers of one trainer, driven together (the trainer's side of the seam).

    Args:
        loggers: Logger instances and/or names (``"tensorboard"``, ``"mlflow"``,
            ``"wandb"``, ``"csv"``), a comma-separated string of names, or None.
        log_dir: where loggers given by name write (default: :func:`default_log_dir`).

    ``start`` and ``finish`` are idempotent; ``log_metrics`` before ``start`` starts
    the loggers with an empty ``run_info``. A logger's exception is re-raised as
    :class:`LoggerError` naming it; ``finish`` finishes every logger before raising.
    """

    def __init__(self, loggers: Any = None, log_dir: str | Path | None = None) -> None:
        self.loggers: list[Logger] = resolve_loggers(loggers, log_dir)
        self._started = False
        self._finished = False

    def __len__(self) -> int:
        return len(self.loggers)

    def __iter__(self) -> Iterator[Logger]:
        return iter(self.loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def __repr__(self) -> str:
        return f"LoggerSet([{', '.join(type(lg).__name__ for lg in self.loggers)}])"

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran."""
        return self._started

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Start every logger with the run's information (only the first call counts)."""
        if self._started or self._finished:
            return
        self._started = True
        for logger in self.loggers:
            _call(logger, "start", dict(run_info))

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """Send reduced metrics to every logger (see :meth:`Logger.log_metrics`)."""
        if self._finished:
            raise LoggerError(
                "log_metrics() after finish(): the loggers of this run are closed; "
                "create a new trainer (or LoggerSet) for a new run."
            )
        if not self._started:
            self.start({})
        for logger in self.loggers:
            _call(logger, "log_metrics", dict(metrics), int(step), int(epoch), str(prefix))

    def finish(self) -> None:
        """Finish every logger once (those that fail are reported after all ran)."""
        if self._finished:
            return
        self._finished = True
        if not self._started:
            return
        errors = []
        for logger in self.loggers:
            try:
                _call(logger, "finish")
            except LoggerError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def _call(logger: Logger, method: str, *args: Any) -> None:
    try:
        getattr(logger, method)(*args)
    except PolytrainError:
        raise
    except Exception as exc:
        raise LoggerError(
            f"Logger {type(logger).__name__} ({logger.name!r}) failed in {method}(): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
