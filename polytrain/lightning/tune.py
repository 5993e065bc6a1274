"""Report a Lightning run, and its checkpoints, to Ray Tune from inside a RayStrategy worker group.

:class:`TuneReportCallback` reports metrics; :class:`TuneReportCheckpointCallback`
(ray_lightning's name and arguments) reports a Lightning checkpoint with them, so
that Tune keeps a best checkpoint and restores trials (failures, PBT) from it.
:func:`get_tune_resources` is ray_lightning's name for the trial's placement group.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytorch_lightning.callbacks import Callback

from polytrain.errors import ConfigError
from polytrain.launchers.worker import WORKER_STATE

#: The Lightning events (``on_<event>`` hooks) a report can follow.
HOOKS = (
    "validation_end",
    "validation_epoch_end",
    "train_epoch_end",
    "train_batch_end",
    "train_end",
    "test_end",
)

#: WORKER_STATE key of the queue that rank 0's Tune callbacks write to.
TUNE_QUEUE_KEY = "lightning_tune_queue"


@dataclass
class TuneReport:
    """One report from rank 0 to the Tune trial: metrics, and the checkpoint's files if any."""

    metrics: dict[str, Any]
    files: dict[str, bytes] | None = None


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
        on: when to report: one event or a list of them, from :data:`HOOKS`
            ("validation_end" (default), "train_epoch_end", "train_batch_end", ...).

    Raises:
        polytrain.errors.ConfigError: an event that is not one of them (a ``ValueError``).
    """

    def __init__(
        self,
        metrics: str | Sequence[str] | Mapping[str, str] | None = None,
        on: str | Sequence[str] = "validation_end",
    ) -> None:
        events = [on] if isinstance(on, str) else list(on)
        unknown = [event for event in events if event not in HOOKS]
        if unknown or not events:
            raise ConfigError(f"on={on!r} is not supported. Must be one (or a list) of {HOOKS}.")
        if isinstance(metrics, str):
            metrics = [metrics]
        if metrics is not None and not isinstance(metrics, Mapping):
            metrics = {name: name for name in metrics}
        self._metrics: Mapping[str, str] | None = metrics
        self._on = tuple(events)

    def _collect(self, trainer: Any) -> dict[str, Any]:
        logged = trainer.callback_metrics
        if self._metrics is None:
            chosen = dict(logged)
        else:
            missing = [source for source in self._metrics.values() if source not in logged]
            if missing:
                raise KeyError(
                    f"{type(self).__name__}: metric(s) {missing} were not logged; logged "
                    f"metrics are {sorted(logged)}. Log them with self.log(...) or change `metrics`."
                )
            chosen = {name: logged[source] for name, source in self._metrics.items()}
        report = {name: _to_python(value) for name, value in chosen.items()}
        report.setdefault("epoch", trainer.current_epoch)
        report.setdefault("step", trainer.global_step)
        return report

    def _handle(self, trainer: Any, event: str) -> None:
        if event not in self._on or trainer.sanity_checking or not trainer.is_global_zero:
            return
        send_report(TuneReport(self._collect(trainer)))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Report after every validation run (``on="validation_end"``)."""
        self._handle(trainer, "validation_end")

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Report at the end of every validation epoch (``on="validation_epoch_end"``)."""
        self._handle(trainer, "validation_epoch_end")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Report after every training epoch (``on="train_epoch_end"``)."""
        self._handle(trainer, "train_epoch_end")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Report after every training batch (``on="train_batch_end"``)."""
        self._handle(trainer, "train_batch_end")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Report when training ends (``on="train_end"``)."""
        self._handle(trainer, "train_end")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        """Report when testing ends (``on="test_end"``)."""
        self._handle(trainer, "test_end")


class TuneReportCheckpointCallback(TuneReportCallback):
    """Report metrics and a checkpoint to Ray Tune at every ``on`` event (ray_lightning's callback).

    Every worker takes part in ``trainer.save_checkpoint`` (sharded backends gather
    the consolidated state); rank 0's file is reported with the metrics as a
    ``ray.tune.Checkpoint`` of a directory holding ``filename``. Tune keeps it
    (``result.checkpoint``, ``result_grid.get_best_result().checkpoint``) and hands
    it back when it restores the trial: resume from it with ``ckpt_path``.

    Example:
        >>> def train_fn(config):
        ...     trainer = pl.Trainer(max_epochs=4, strategy=RayStrategy(num_workers=2),
        ...         callbacks=[TuneReportCheckpointCallback({"acc": "val_accuracy"})])
        ...     checkpoint = tune.get_checkpoint()   # set when Tune restores the trial
        ...     if checkpoint is None:
        ...         return trainer.fit(Model(config["lr"]))
        ...     with checkpoint.as_directory() as path:
        ...         trainer.fit(Model(config["lr"]), ckpt_path=os.path.join(path, "checkpoint"))

    Args:
        metrics: as for :class:`TuneReportCallback`.
        filename: the checkpoint's file name inside the reported directory.
        on: as for :class:`TuneReportCallback`.

    Raises:
        polytrain.errors.ConfigError: a bad ``on`` or ``filename``.
    """

    def __init__(
        self,
        metrics: str | Sequence[str] | Mapping[str, str] | None = None,
        filename: str = "checkpoint",
        on: str | Sequence[str] = "validation_end",
    ) -> None:
        super().__init__(metrics, on)
        if not isinstance(filename, str) or not filename or os.path.basename(filename) != filename:
            raise ConfigError(
                f"filename must be a plain file name (the checkpoint inside the directory "
                f"reported to Tune), e.g. 'checkpoint'; got {filename!r}."
            )
        self._filename = filename

    def _handle(self, trainer: Any, event: str) -> None:
        if event not in self._on or trainer.sanity_checking:
            return
        # Every rank saves (a collective for sharded backends); rank 0 writes the file.
        with tempfile.TemporaryDirectory(prefix="polytrain-tune-") as directory:
            trainer.save_checkpoint(os.path.join(directory, self._filename))
            if not trainer.is_global_zero:
                return
            metrics = self._collect(trainer)
            if WORKER_STATE.get(TUNE_QUEUE_KEY) is None:  # in the trial's own process
                report_to_tune(metrics, directory)
            else:
                send_report(TuneReport(metrics, read_directory(directory)))


def send_report(report: TuneReport) -> None:
    """Rank 0: queue ``report`` for the trial's process, or report it here (no RayStrategy)."""
    queue = WORKER_STATE.get(TUNE_QUEUE_KEY)
    if queue is not None:
        queue.put(report)
    elif report.files is None:
        report_to_tune(report.metrics)
    else:
        deliver_report(report)


def deliver_report(report: TuneReport) -> None:
    """Trial process: ``ray.tune.report`` one report, writing its checkpoint files first."""
    if report.files is None:
        report_to_tune(report.metrics)
        return
    with tempfile.TemporaryDirectory(prefix="polytrain-tune-") as directory:
        for name, data in report.files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as file:
                file.write(data)
        report_to_tune(report.metrics, directory)  # Tune copies it before returning


def report_to_tune(metrics: dict[str, Any], checkpoint_dir: str | None = None) -> None:
    """Call ``ray.tune.report`` in this process (the Tune trial's), with a checkpoint directory."""
    from ray import tune

    if checkpoint_dir is None:
        tune.report(metrics)
    else:
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(checkpoint_dir))


def read_directory(directory: str) -> dict[str, bytes]:
    """Every file under ``directory``, by relative path (a checkpoint may be a directory)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as file:
                files[os.path.relpath(path, directory)] = file.read()
    return files


def get_tune_resources(
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    use_gpu: bool = False,
    resources_per_worker: dict[str, float] | None = None,
    *,
    num_gpus_per_worker: float | None = None,
    placement_strategy: str = "PACK",
    trainable_resources: dict[str, float] | None = None,
) -> Any:
    """ray_lightning's name of :func:`polytrain.tune.tune_resources`: a trial's placement group.

    Bundle 0 holds the trial's own process; one bundle per worker follows, shaped
    like a :class:`RayStrategy`'s workers with the same options (``resources_per_worker``
    CPU/GPU entries folded in, ``num_gpus_per_worker`` fractional or several).

    Raises:
        polytrain.errors.ConfigError: options a strategy would refuse.
    """
    from polytrain.trainer_api.trainable import tune_resources

    return tune_resources(
        num_workers,
        num_cpus_per_worker,
        use_gpu,
        resources_per_worker,
        trainable_resources,
        placement_strategy,
        num_gpus_per_worker=num_gpus_per_worker,
    )


def _to_python(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    return value
