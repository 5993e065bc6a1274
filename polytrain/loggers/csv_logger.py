"""CSVLogger: one ``metrics.csv`` row per ``train()`` / ``validate()`` and a ``hparams.yaml``."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from polytrain.loggers.base import Logger, flatten_params, scalar_metrics


class CSVLogger(Logger):
    """Writes ``save_dir/metrics.csv`` (columns ``step``, ``epoch``, then ``train/loss``, ...).

    The header is the union of the metric names seen so far: when a new name
    appears the file is rewritten with the wider header (rows keep their values,
    missing cells stay empty), as Lightning's CSVLogger does. The run's
    information goes to ``save_dir/hparams.yaml`` once.

    Args:
        save_dir: the directory (created on start).
        filename: the metrics file's name.
    """

    name: ClassVar[str] = "csv"

    def __init__(self, save_dir: str | Path, filename: str = "metrics.csv") -> None:
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / filename
        self.hparams_path = self.save_dir / "hparams.yaml"
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step", "epoch"]

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Create the directory and write ``hparams.yaml``."""
        import yaml

        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.hparams_path.write_text(yaml.safe_dump(flatten_params(run_info), sort_keys=False))
        self.path.write_text(",".join(self._columns) + "\n")

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """Append one row (rewrite the file when the row brings new columns)."""
        row = {"step": step, "epoch": epoch, **scalar_metrics(metrics, prefix)}
        self._rows.append(row)
        new = [key for key in row if key not in self._columns]
        if new:
            self._columns += new
            self._write(self._rows, "w", header=True)
        else:
            self._write([row], "a", header=False)

    def _write(self, rows: list[dict[str, Any]], mode: str, header: bool) -> None:
        with self.path.open(mode, newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._columns, restval="")
            if header:
                writer.writeheader()
            writer.writerows(rows)
