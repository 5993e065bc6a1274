"""WandbLogger: Weights & Biases, online or offline (no network needed offline)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from polytrain.loggers.base import Logger, check_installed, scalar_metrics


def _default_mode() -> str:
    # Online only when the user has set W&B up; a fresh machine must never block on a login.
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbLogger(Logger):
    """Logs a W&B run: the run information as its config, metrics with ``step`` and ``epoch``.

    Offline runs are written to ``save_dir/wandb/offline-run-*`` and can be
    uploaded later with ``wandb sync``.

    Args:
        project: the W&B project.
        name: the run's display name.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; default ``WANDB_MODE``, else
            online when ``WANDB_API_KEY`` is set, else offline.
        save_dir: where W&B writes its files (default ``./polytrain_runs``).
        **init_kwargs: more ``wandb.init`` arguments (``entity``, ``tags``, ``group``, ...).

    Attributes:
        run: the ``wandb`` run once started.
    """

    name: ClassVar[str] = "wandb"

    def __init__(
        self,
        project: str = "polytrain",
        name: str | None = None,
        mode: str | None = None,
        save_dir: str | Path | None = None,
        **init_kwargs: Any,
    ) -> None:
        check_installed("wandb", "WandbLogger")
        self.project = project
        self.run_name = name
        self.mode = mode or _default_mode()
        self.save_dir = Path(save_dir) if save_dir is not None else Path("polytrain_runs")
        self.init_kwargs = init_kwargs
        self.run: Any = None

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Start the W&B run with the run information as its config."""
        import wandb

        self.save_dir.mkdir(parents=True, exist_ok=True)
        kwargs = {
            "settings": wandb.Settings(console="off", silent=True),
            "reinit": "create_new",  # several trainers in one process: one run each
            **self.init_kwargs,
        }
        self.run = wandb.init(
            project=self.project,
            name=self.run_name,
            mode=self.mode,
            dir=str(self.save_dir),
            config=dict(run_info),
            **kwargs,
        )

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """Log the metrics and the epoch at W&B step ``step``."""
        self.run.log({**scalar_metrics(metrics, prefix), "epoch": epoch}, step=step)

    def finish(self) -> None:
        """Finish the run (an offline run's files are complete afterwards)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
