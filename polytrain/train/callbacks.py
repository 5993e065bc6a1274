"""Ray Train's ``UserCallback``: your code on the driver after each report and after a failure.

``RunConfig(callbacks=[MyCallback()])`` with ``MyCallback(UserCallback)``:
:meth:`UserCallback.after_report` runs on the driver once every worker has made a
report (with every worker's metrics and the committed checkpoint, or None), in report
order, while ``fit()`` runs; :meth:`UserCallback.after_exception` runs whenever workers
failed (before a restart, and for the failure that ends the run). An exception raised in a callback ends the
run (``fit()`` raises a :class:`~polytrain.train.ControllerError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.train.checkpoint import Checkpoint, checkpoint_of

__all__ = ["CallbackSink", "TrainRunContext", "UserCallback"]


@dataclass
class TrainRunContext:
    """What a callback learns about the run (Ray Train's ``TrainRunContext``).

    Attributes:
        run_config: the trainer's :class:`~polytrain.train.RunConfig`.
        train_loop_config: the loop's config.
        scaling_config: the trainer's scaling config.
        backend_config: the backend's config (polytrain's typed config, or a
            :class:`~polytrain.train.BackendConfig`).
        dataset_config: the trainer's :class:`~polytrain.train.DataConfig`.
    """

    run_config: Any
    train_loop_config: dict[str, Any] | None
    scaling_config: Any
    backend_config: Any = None
    dataset_config: Any = None

    def get_run_config(self) -> Any:
        """The trainer's run config."""
        return self.run_config


class UserCallback:
    """Base class of your driver-side callbacks (Ray Train's ``UserCallback``)."""

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
    ) -> None:
        """Called once every worker has reported a step.

        Args:
            run_context: the run.
            metrics: ``metrics[i]`` is what worker ``i`` reported.
            checkpoint: the committed checkpoint of that step, or None.
        """

    def after_exception(
        self, run_context: TrainRunContext, worker_exceptions: dict[int, Exception]
    ) -> None:
        """Called when workers failed: before each restart ``FailureConfig.max_failures``
        allows, and for the failure that ends the run.

        Args:
            run_context: the run.
            worker_exceptions: world rank -> that worker's exception.
        """


class CallbackSink:
    """Driver: hands each report (every rank's metrics) to the callbacks, in report order.

    Args:
        callbacks: the :class:`UserCallback` instances of ``RunConfig(callbacks=...)``.
        context: the run's :class:`TrainRunContext`.
    """

    def __init__(self, callbacks: list[UserCallback], context: TrainRunContext) -> None:
        self.callbacks = list(callbacks)
        self.context = context

    def __call__(self, entry: dict[str, Any]) -> None:
        url = entry.get("_checkpoint")
        checkpoint = checkpoint_of(url, entry.get("_checkpoint_kind")) if url else None
        metrics = [dict(m or {}) for m in entry.get("_worker_metrics") or []]
        for callback in self.callbacks:
            callback.after_report(self.context, metrics, checkpoint)

    def failed(self, worker_exceptions: dict[int, Exception]) -> None:
        """The run ends because workers failed."""
        for callback in self.callbacks:
            callback.after_exception(self.context, dict(worker_exceptions))
