"""Ray Train's Keras callbacks: report Keras logs (and checkpoints) from ``model.fit``.

Imports TensorFlow (in a worker of ``TensorflowTrainer``, with ``TF_USE_LEGACY_KERAS=1``
set by the ``mwms`` backend, that is ``tf_keras``).
"""

from __future__ import annotations

import shutil
from typing import Any

import tensorflow as tf

from polytrain.errors import ConfigError
from polytrain.train import session as train_session
from polytrain.train.tensorflow.checkpoint import TensorflowCheckpoint

__all__ = ["RayReportCallback", "ReportCheckpointCallback"]

_EVENTS = (
    "epoch_begin", "epoch_end", "train_batch_begin", "train_batch_end", "test_batch_begin",
    "test_batch_end", "predict_batch_begin", "predict_batch_end", "train_begin", "train_end",
    "test_begin", "test_end", "predict_begin", "predict_end",
)  # fmt: skip


def _events(value: str | list[str], name: str) -> list[str]:
    events = [value] if isinstance(value, str) else list(value)
    wrong = [e for e in events if e not in _EVENTS]
    if wrong:
        raise ConfigError(f"Invalid trigger time {wrong} for {name}. Must be one of {_EVENTS}.")
    return events


class RayReportCallback(tf.keras.callbacks.Callback):
    """Reports Keras logs at the chosen events, with a checkpoint of the model at others.

    Args:
        checkpoint_on: event(s) at which the model is checkpointed (with the metrics).
        report_metrics_on: event(s) at which the metrics alone are reported.
        metrics: None (every log), a log name, a list of names, or ``{reported: log name}``.
    """

    def __init__(
        self,
        checkpoint_on: str | list[str] = "epoch_end",
        report_metrics_on: str | list[str] = "epoch_end",
        metrics: str | list[str] | dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._checkpoint_on = _events(checkpoint_on, "checkpoint_on")
        self._report_metrics_on = _events(report_metrics_on, "report_metrics_on")
        self._metrics = metrics

    def _reported(self, logs: dict[str, Any] | None) -> dict[str, Any]:
        logs = dict(logs or {})
        if self._metrics is None:
            return logs
        if isinstance(self._metrics, str):
            return {self._metrics: logs[self._metrics]}
        if isinstance(self._metrics, list):
            return {m: logs[m] for m in self._metrics}
        return {key: logs[m] for key, m in self._metrics.items()}

    def _handle(self, logs: dict[str, Any] | None, when: str) -> None:
        if when not in self._checkpoint_on and when not in self._report_metrics_on:
            return
        metrics = {
            k: float(v) if hasattr(v, "__float__") else v for k, v in self._reported(logs).items()
        }
        if when in self._checkpoint_on:
            checkpoint = TensorflowCheckpoint.from_model(self.model)
            try:
                train_session.report(metrics, checkpoint=checkpoint)
            finally:
                shutil.rmtree(checkpoint.location, ignore_errors=True)
        else:
            train_session.report(metrics)


def _hook(event: str) -> Any:
    if "batch" in event or "epoch" in event:

        def hook(self: RayReportCallback, index: int, logs: Any = None) -> None:
            self._handle(logs, event)
    else:

        def hook(self: RayReportCallback, logs: Any = None) -> None:
            self._handle(logs, event)

    hook.__name__ = f"on_{event}"
    return hook


for _event in _EVENTS:  # Keras calls on_<event>; each reports when it is chosen
    setattr(RayReportCallback, f"on_{_event}", _hook(_event))


class ReportCheckpointCallback(RayReportCallback):
    """Ray Train's Keras callback: metrics and a model checkpoint at each epoch end by default."""
