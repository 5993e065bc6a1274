"""``Result``: what ``fit()`` returns (Ray Train's shape)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from polytrain.checkpoint.storage import Storage, normalize
from polytrain.errors import ConfigError
from polytrain.train.checkpoint import (
    Checkpoint,
    checkpoint_of,
    pyarrow_filesystem,
    pyarrow_location,
)


@dataclass
class Result:
    """The outcome of ``fit()``.

    Attributes:
        metrics: rank 0's last reported metrics (Ray Train 2.x: the last *checkpoint's*;
            they are the same when the loop reports a checkpoint each time).
        checkpoint: the latest committed checkpoint, or None.
        error: the error that ended the run (``fit()`` raises it; Tune keeps it here).
        path: the run's directory: a local path or URL, or the path on
            ``RunConfig.storage_filesystem`` when one was given.
        metrics_history: every report of rank 0, oldest first.
        best_checkpoints: ``(checkpoint, metrics)`` of the kept checkpoints as Ray Train
            gives them: the ``num_to_keep`` best by ``checkpoint_score_attribute``, worst
            first (by report order without a score attribute; all without
            ``num_to_keep``). The latest checkpoint, always kept on disk, is not in this
            list unless it is among the best.
        return_value: what the loop returned on rank 0 (None when it returned nothing).
    """

    metrics: dict[str, Any]
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    _storage_filesystem: Any = field(default=None, repr=False)

    @property
    def metrics_dataframe(self) -> Any:
        """Every report of rank 0 as a ``pandas.DataFrame``, one row a report."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` :attr:`path` is on (Ray Train's)."""
        if self._storage_filesystem is not None:
            return self._storage_filesystem
        return pyarrow_filesystem(self.path)

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The kept checkpoint with the best ``metric`` (``mode``: "max" or "min"); NaN never wins.

        Raises:
            ConfigError: a ``mode`` other than "max" / "min".
            RuntimeError: no kept checkpoint reported ``metric``.
        """
        if mode not in ("max", "min"):
            raise ConfigError(f"get_best_checkpoint(mode={mode!r}) must be 'max' or 'min'.")
        scored = [
            (value, checkpoint)
            for checkpoint, metrics in self.best_checkpoints
            if isinstance(value := metrics.get(metric), (int, float)) and not math.isnan(value)
        ]
        if not scored:
            raise RuntimeError(
                f"Invalid metric name {metric!r}: no kept checkpoint reported it as a number; they "
                f"report {sorted({k for _, m in self.best_checkpoints for k in m})}."
            )
        pick = max if mode == "max" else min
        return pick(scored, key=lambda pair: pair[0])[1]

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None) -> Result:
        """The result of a finished run, read from its directory (Ray Train's ``Result.from_path``).

        ``metrics`` are the latest checkpoint's; ``metrics_history`` holds every kept
        checkpoint's metrics, oldest first.

        Raises:
            RuntimeError: no such directory, or no committed checkpoint of a run in it.
        """
        from polytrain.train.board import ReportBoard
        from polytrain.train.config import CheckpointConfig

        text = os.fspath(path)
        location = pyarrow_location(storage_filesystem, text) if storage_filesystem else text
        if not Storage(location).exists():
            raise RuntimeError(f"Experiment folder {text} doesn't exist.")
        board = ReportBoard(location, CheckpointConfig())
        if not board.committed:
            raise RuntimeError(
                f"Failed to restore the Result object: {text} holds no committed checkpoint of a "
                f"polytrain.train run. Make sure that this is an output directory created by a "
                f"run (RunConfig(storage_path)/name) that reported a checkpoint."
            )
        snapshot = board.snapshot()
        result = from_snapshot(snapshot, location, text, storage_filesystem)
        result.metrics = dict(snapshot["committed"][-1][1]) if snapshot["committed"] else {}
        result.metrics_history = [dict(m) for _, m in snapshot["committed"]]
        return result


def from_snapshot(
    snapshot: dict[str, Any], run_url: str, run_path: str | None = None, filesystem: Any = None
) -> Result:
    """The :class:`Result` of a board's snapshot.

    Args:
        snapshot: :meth:`ReportBoard.snapshot`.
        run_url: the run's location (path or URL).
        run_path: the run's path on ``filesystem`` (when the run config named one).
        filesystem: ``RunConfig.storage_filesystem``, or None.
    """
    from polytrain.train.feed import public

    kinds = snapshot.get("kinds") or {}

    def checkpoint(url: str) -> Checkpoint:
        if filesystem is None:
            return checkpoint_of(url, kinds.get(url))
        relative = normalize(url)[len(normalize(run_url)) :]
        path = f"{run_path.rstrip('/')}{relative}"
        return checkpoint_of(path, kinds.get(url), filesystem=filesystem)

    history = snapshot["history"]
    latest = snapshot.get("latest")
    return Result(
        metrics=public(history[-1]) if history else {},
        checkpoint=checkpoint(latest) if latest else None,
        error=None,
        path=run_path if filesystem is not None else run_url,
        metrics_history=[public(entry) for entry in history],
        best_checkpoints=[(checkpoint(url), metrics) for url, metrics in snapshot["best"]],
        return_value=snapshot.get("return_value"),
        _storage_filesystem=filesystem,
    )
