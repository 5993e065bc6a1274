"""MLflowLogger: parameters and metrics through MLflow's tracking client (any tracking URI)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from polytrain.loggers.base import Logger, check_installed, flatten_params, scalar_metrics

#: MLflow's limit on the length of a parameter value.
_MAX_PARAM_CHARS = 6000


class MLflowLogger(Logger):
    """Logs to an MLflow tracking store; by default a local one under ``save_dir``.

    Parameters are the flattened run information (``config/lr``, ``backend``,
    ``num_workers``, ``framework``), logged once; every metric is logged with
    ``step`` (MLflow's x axis) and an ``epoch`` metric beside it.

    The default store is ``sqlite:///<save_dir>/mlflow.db`` with artifacts in
    ``<save_dir>/mlartifacts``: MLflow 3 keeps its ``./mlruns`` file store in
    maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``. Any
    other store works through ``tracking_uri`` (``http://host:5000``,
    ``databricks``, ``file:...``) or the ``MLFLOW_TRACKING_URI`` variable.

    Args:
        tracking_uri: where to log; default ``MLFLOW_TRACKING_URI``, else the local store.
        experiment_name: created when missing.
        run_name: the run's name (default: MLflow's generated one).
        save_dir: the directory of the default local store (default ``./polytrain_runs``).
        tags: tags set on the run.

    Attributes:
        run_id: the MLflow run's id once started.
    """

    name: ClassVar[str] = "mlflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str = "polytrain",
        run_name: str | None = None,
        save_dir: str | Path | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        check_installed("mlflow", "MLflowLogger")
        self.save_dir = Path(save_dir) if save_dir is not None else Path("polytrain_runs")
        self._default_store = tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = (
            tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{self.save_dir.resolve() / 'mlflow.db'}"
        )
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.client: Any = None
        self.run_id: str | None = None

    def _experiment_id(self) -> str:
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        artifacts = None
        if self._default_store:
            artifacts = (self.save_dir.resolve() / "mlartifacts").as_uri()
        return self.client.create_experiment(self.experiment_name, artifact_location=artifacts)

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Create the run and log the parameters."""
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self._default_store:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        run = self.client.create_run(self._experiment_id(), run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        params = [
            Param(key, str(value)[:_MAX_PARAM_CHARS])
            for key, value in flatten_params(run_info).items()
        ]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[first : first + 100])

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """Log every metric and the epoch at ``step``."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {**scalar_metrics(metrics, prefix), "epoch": float(epoch)}
        batch = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self) -> None:
        """Mark the run finished."""
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
            self.client = None
