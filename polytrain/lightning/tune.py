"""Report a Lightning run to Ray Tune from inside a RayStrategy worker group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytorch_lightning.callbacks import Callback

from polytrain.errors import ConfigError
from polytrain.launchers.worker import WORKER_STATE

_HOOKS = ("validation_end", "train_epoch_end")

#: WORKER_STATE key of the queue that rank 0's TuneReportCallback writes to.
TUNE_QUEUE_KEY = "lightning_tune_queue"


class TuneReportCallback(Callback):
    """Report metrics to Ray Tune; works under :class:`~polytrain.lightning.RayStrategy`.

    Under a RayStrategy the training runs in actors, not in the Tune trial's
    process, where ``tune.report`` must be called. On rank 0 the callback puts the
    metrics on a queue that the strategy's launcher, in the trial's process,
    drains into ``tune.report``. Without a RayStrategy it calls ``tune.report``
    directly.

    Example:
        >>> def train_fn(config):
        ...     trainer = pl.Trainer(
        ...         max_epochs=4,
        ...         strategy=RayStrategy(num_workers=2),
        ...         callbacks=[TuneReportCallback({"acc": "val_accuracy"})])
        ...     trainer.fit(Model(lr=config["lr"]))
        >>> tune.Tuner(tune.with_resources(train_fn, tune_resources(num_workers=2)), ...)

    Args:
        metrics: which ``trainer.callback_metrics`` to report: None for all, a list
            of names, or a dict ``{name reported to Tune: name logged in Lightning}``.
        on: when to report: "validation_end" (default) or "train_epoch_end".

    Raises:
        polytrain.errors.ConfigError: ``on`` is not one of them (a ``ValueError``).
    """

    def __init__(
        self,
        metrics: str | Sequence[str] | Mapping[str, str] | None = None,
        on: str = "validation_end",
    ) -> None:
        if on not in _HOOKS:
            raise ConfigError(f"on={on!r} is not supported. Must be one of {_HOOKS}.")
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not isinstance(metrics, Mapping):
            metrics = {name: name for name in metrics}
        self._metrics: Mapping[str, str] | None = metrics
        self._on = on

    def _collect(self, trainer: Any) -> dict[str, Any]:
        logged = trainer.callback_metrics
        if self._metrics is None:
            chosen = dict(logged)
        else:
            missing = [source for source in self._metrics.values() if source not in logged]
            if missing:
                raise KeyError(
                    f"TuneReportCallback: metric(s) {missing} were not logged; logged metrics "
                    f"are {sorted(logged)}. Log them with self.log(...) or change `metrics`."
                )
            chosen = {name: logged[source] for name, source in self._metrics.items()}
        report = {name: _to_python(value) for name, value in chosen.items()}
        report.setdefault("epoch", trainer.current_epoch)
        report.setdefault("step", trainer.global_step)
        return report

    def _report(self, trainer: Any) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = self._collect(trainer)
        queue = WORKER_STATE.get(TUNE_QUEUE_KEY)
        if queue is not None:
            queue.put(metrics)
        else:
            report_to_tune(metrics)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Report after every validation run (when ``on="validation_end"``)."""
        if self._on == "validation_end":
            self._report(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Report after every training epoch (when ``on="train_epoch_end"``)."""
        if self._on == "train_epoch_end":
            self._report(trainer)


def report_to_tune(metrics: dict[str, Any]) -> None:
    """Call ``ray.tune.report`` in this process (the Tune trial's)."""
    from ray import tune

    tune.report(metrics)


def _to_python(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    return value
