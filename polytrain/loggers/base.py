"""The :class:`Logger` interface and the helpers every logger uses (flattening, scalars, log dir).

A logger records one run: :meth:`Logger.start` once with the run's information
(the user's config, the backend, the number of workers, the framework),
:meth:`Logger.log_metrics` after every ``train()`` / ``validate()`` with the
metrics already reduced over the workers (so nothing is logged twice), and
:meth:`Logger.finish` at the end. Everything runs in the driver process.

This module imports no tracking library and no logger; each built-in logger imports its own
when it starts.
"""

from __future__ import annotations

import abc
import math
import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from polytrain.compat.imports import install_hint, module_available
from polytrain.errors import MissingDependencyError, PolytrainError

__all__ = [
    "Logger",
    "LoggerError",
    "default_log_dir",
    "flatten_params",
    "scalar_metrics",
]

#: Metrics that are axes, not values: logged as the step / epoch of every record.
AXIS_KEYS = frozenset({"epoch", "step"})


class LoggerError(PolytrainError, RuntimeError):
    """A logger failed to start, record or finish; the message names the logger."""


class Logger(abc.ABC):
    """One experiment tracker. Subclass it to send metrics anywhere else.

    All methods run in the driver. ``start`` is called once per run before the
    first ``log_metrics``; ``finish`` once at the end.
    """

    #: The name used in ``loggers=["..."]`` and in error messages.
    name: ClassVar[str] = "logger"

    @abc.abstractmethod
    def start(self, run_info: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters and settings (once per run).

        Args:
            run_info: ``{"config": {...}, "backend": "ddp", "num_workers": 2,
                "framework": "torch", ...}``; see :func:`flatten_params` for a flat view.
        """

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """Record reduced metrics.

        Args:
            metrics: the dict ``train()`` or ``validate()`` returned (non-numeric
                values may be present; :func:`scalar_metrics` keeps the numbers).
            step: the global step: batches trained so far by each worker.
            epoch: the epoch these metrics belong to.
            prefix: ``"train"`` or ``"val"``.
        """

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Flush and close (default: nothing to do)."""


# ------------------------------------------------------------------- helpers
def default_log_dir(root: str | Path = "polytrain_runs") -> Path:
    """``root/run-<YYYYmmdd-HHMMSS>`` (suffixed when taken): where named loggers write by default."""
    base = Path(root) / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_installed(module: str, feature: str) -> None:
    """Raise :class:`MissingDependencyError` (with the install command) unless ``module`` is there.

    Answered without importing ``module``: resolving names stays cheap.
    """
    if not module_available(module):
        raise MissingDependencyError(
            f"{feature} needs the Python package '{module}', which is not installed. "
            f"Install it with: {install_hint(module)}"
        )


def _is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def scalar_metrics(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The numeric metrics named ``prefix/name``: ``{"val_loss": 0.3}`` -> ``{"val/loss": 0.3}``.

    A key that already starts with ``prefix_`` loses that start; the axes
    (``epoch``, ``step``) and non-numeric values are left out.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in AXIS_KEYS or not _is_scalar(value):
            continue
        name = key[len(prefix) + 1 :] if prefix and key.startswith(f"{prefix}_") else key
        out[f"{prefix}/{name}" if prefix else name] = float(value)
    return out


def flatten_params(run_info: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Nested run information as one level of ``int | float | str | bool`` values.

    ``{"config": {"lr": 0.1}}`` -> ``{"config/lr": 0.1}``; None and other objects
    become their ``str``; lists and tuples their ``repr``.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(f"{prefix}{sep}{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)) and not (
            isinstance(value, float) and math.isnan(value)
        ):
            flat[prefix] = value
        else:
            flat[prefix] = str(value) if not isinstance(value, (list, tuple)) else repr(value)

    walk("", dict(run_info))
    return flat
