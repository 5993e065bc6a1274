"""``Result``: what ``fit()`` returns (Ray Train's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytrain.train.checkpoint import Checkpoint


@dataclass
class Result:
    """The outcome of ``fit()``.

    Attributes:
        metrics: rank 0's last reported metrics.
        checkpoint: the latest committed checkpoint, or None.
        error: the error that ended the run (``fit()`` raises it; Tune keeps it here).
        path: the run's directory (local path or URL).
        metrics_history: every report of rank 0, oldest first.
        best_checkpoints: ``(checkpoint, metrics)`` of every kept checkpoint, oldest first.
    """

    metrics: dict[str, Any]
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)

    @property
    def metrics_dataframe(self) -> Any:
        """Every report of rank 0 as a ``pandas.DataFrame``, one row a report."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)
