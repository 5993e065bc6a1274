"""Ray Tune trainables built from polytrain trainers.

``TorchTrainer.as_trainable(...)`` (and ``TFTrainer.as_trainable``) return a
function trainable for :class:`ray.tune.Tuner`. Every trial builds its own
trainer, trains epoch by epoch, and after each epoch reports the reduced train
and validation metrics to Tune together with a checkpoint written by
``trainer.save()``; a trial that Tune restores (PBT exploit, a paused ASHA trial,
a retried failure) resumes with ``trainer.load()``. A trial restored with another
config than its checkpoint's (a PBT exploit that mutated ``lr``) keeps the
checkpoint's weights and optimizer state but takes the new config's optimizer
hyperparameters (see :func:`follow_config_changes`). The trial's placement group
holds a bundle for the trainable (bundle 0) and one per worker, and the trainer
starts its workers inside it.

Trial config keys update the trainer's ``config`` dict, except the keys in
:data:`TRAINER_OPTION_KEYS`, which set trainer options:

* ``backend``, ``backend_config``, ``use_fp16``: any trial may choose them, so
  ``tune.choice(["ddp", "horovod"])`` searches over backends.
* ``num_workers``, ``num_cpus_per_worker``, ``use_gpu``: read when Tune creates
  the trial's placement group, so they too may be searched (``tune.choice([1,
  2])``). A running trial's placement group cannot change: a scheduler that
  mutates them (PBT's ``hyperparam_mutations``) gets the new value only when the
  trial restarts, so leave them out of mutations.

Example::

    trainable = TorchTrainer.as_trainable(
        model_creator=..., data_creator=..., optimizer_creator=...,
        loss_creator=torch.nn.CrossEntropyLoss, num_workers=2,
        config={"batch_size": 64}, num_epochs=10)
    tuner = tune.Tuner(trainable, param_space={
        "lr": tune.loguniform(1e-3, 1e-1), "backend": tune.choice(["ddp", "horovod"])},
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max",
                                    scheduler=ASHAScheduler(), num_samples=8))

Warm workers across trials: a trial's workers live in the trial's placement
group and are owned by the trial's trainable actor, so they can outlive a
trial only together with that actor. With ``tune.TuneConfig(reuse_actors=True)``
Tune keeps the trainable actor and its placement group for the next trial of
the same resources, and that trial's trainer takes the previous trial's workers
from the actor's warm pool (:mod:`polytrain.launchers.pool.warm_pool`), reset, with torch
and the backend imported: no new actors, no imports. Without it (Tune's default)
every trial starts cold: Tune removes the placement group, and Ray kills the
workers with it and with their owner.

The module lives in ``trainer_api`` so that ``BaseTrainer.as_trainable`` needs
nothing above it; :mod:`polytrain.tune` is its public face. ``ray.tune`` is
imported only when a trainable or a placement group is built, so importing a
trainer never loads it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from polytrain.compat.imports import require
from polytrain.errors import ConfigError
from polytrain.trainer_api.options.configs import ScalingConfig, coerce_config

if TYPE_CHECKING:  # pragma: no cover
    from ray.tune import PlacementGroupFactory

__all__ = [
    "CHECKPOINT_FILE",
    "CONFIG_FILE",
    "TRAINER_OPTION_KEYS",
    "follow_config_changes",
    "make_trainable",
    "placement_group_factory",
    "tune_resources",
]

logger = logging.getLogger(__name__)

#: Trial config keys that set trainer options instead of entries of ``config``.
TRAINER_OPTION_KEYS = (
    "backend",
    "backend_config",
    "use_fp16",
    "num_workers",
    "num_cpus_per_worker",
    "use_gpu",
)
_SCALING_KEYS = ("num_workers", "num_cpus_per_worker", "use_gpu")

#: File name of the trainer checkpoint inside each Tune checkpoint directory.
CHECKPOINT_FILE = "polytrain_checkpoint.pt"
#: File name of the trainer's ``config`` (JSON) next to it: a restore compares it with its own.
CONFIG_FILE = "polytrain_config.json"


def _tune() -> ModuleType:
    # ray.tune needs Ray's "tune" extra; say how to install it when it is missing.
    return require("ray.tune", "Ray Tune trainables")


# ------------------------------------------------------------ placement
def tune_resources(
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    use_gpu: bool = False,
    resources_per_worker: dict[str, float] | None = None,
    trainable_resources: dict[str, float] | None = None,
    placement_strategy: str = "PACK",
    *,
    num_gpus_per_worker: float | None = None,
) -> PlacementGroupFactory:
    """The placement group a trial needs: bundle 0 for the trainable, one per worker.

    Use it with :func:`ray.tune.with_resources` for a function that trains with a
    :class:`~polytrain.TorchTrainer` or a Lightning ``RayStrategy`` inside a trial;
    the worker group finds this placement group and fills bundles 1..n.

    Args:
        num_workers: workers of the trainer (>= 1).
        num_cpus_per_worker: CPUs per worker bundle.
        use_gpu: one GPU per worker bundle.
        resources_per_worker: extra custom resources per worker bundle.
        trainable_resources: bundle 0, for the trial's own process (default 1 CPU;
            it must not be empty, or the worker group cannot find its bundles).
        placement_strategy: "PACK", "SPREAD", "STRICT_PACK" or "STRICT_SPREAD".
        num_gpus_per_worker: GPUs per worker bundle, fractional or several (implies ``use_gpu``).

    Raises:
        ConfigError: ``num_workers`` < 1 or an empty ``trainable_resources``.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int):
        raise ConfigError(f"num_workers must be an int >= 1 for a Tune trial; got {num_workers!r}.")
    scaling = ScalingConfig(
        num_workers=num_workers,
        num_cpus_per_worker=num_cpus_per_worker,
        use_gpu=use_gpu,
        resources_per_worker=resources_per_worker,
        placement_strategy=placement_strategy,
        num_gpus_per_worker=num_gpus_per_worker,
    )
    return placement_group_factory(scaling, trainable_resources)


def placement_group_factory(
    scaling: ScalingConfig, trainable_resources: dict[str, float] | None = None
) -> PlacementGroupFactory:
    """Ray Tune's placement group for a trial of workers shaped like ``scaling``'s.

    The one place every front end builds it (bundles from
    :meth:`~polytrain.launchers.scaling.ScalingConfig.trial_bundles`).
    """
    bundles = scaling.trial_bundles(trainable_resources)
    return _tune().PlacementGroupFactory(bundles, strategy=scaling.placement_strategy)


def _split_trial_config(
    trial_config: dict[str, Any], trainer_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Trainer kwargs for one trial: options from reserved keys, the rest into ``config``."""
    kwargs = dict(trainer_kwargs)
    config = dict(kwargs.pop("config", None) or {})
    options = {}
    for key, value in trial_config.items():
        if key in TRAINER_OPTION_KEYS:
            options[key] = value
        else:
            config[key] = value
    scaling_options = {k: options.pop(k) for k in _SCALING_KEYS if k in options}
    if scaling_options and kwargs.get("scaling_config") is not None:
        # The trainer refuses an option given both flat and in scaling_config.
        scaling = coerce_config(ScalingConfig, kwargs["scaling_config"], "scaling_config")
        kwargs["scaling_config"] = dataclasses.replace(scaling, **scaling_options)
    else:
        kwargs.update(scaling_options)
    kwargs.update(options)
    kwargs["config"] = config
    return kwargs


def _scaling_of(kwargs: dict[str, Any]) -> ScalingConfig:
    scaling = coerce_config(ScalingConfig, kwargs.get("scaling_config"), "scaling_config")
    flat = {k: kwargs[k] for k in _SCALING_KEYS if kwargs.get(k) is not None}
    return dataclasses.replace(scaling, **flat)


def _resources_of(
    trainer_kwargs: dict[str, Any], trainable_resources: dict[str, float] | None
) -> PlacementGroupFactory:
    """The placement group of a trainer built from ``trainer_kwargs``."""
    return placement_group_factory(_scaling_of(trainer_kwargs), trainable_resources)


# --------------------------------------------------------------- trials
def train_epoch(trainer: Any, num_steps: int | None) -> dict[str, Any]:
    """One epoch, or a shortened one of at most ``num_steps`` batches, on any trainer.

    ``train(num_steps=N)`` continues the epoch (RaySGD's rule); an "epoch of N
    batches" (Tune's ``num_steps``, ``polytrain compare --num-steps``) must end it.
    """
    if num_steps is not None and "end_epoch" in inspect.signature(trainer.train).parameters:
        return trainer.train(num_steps=num_steps, end_epoch=True)
    return trainer.train(num_steps=num_steps)


def _epoch_metrics(trainer: Any, validate: bool, num_steps: int | None) -> dict[str, Any]:
    """Train (and validate) one epoch; the metrics a trial reports for it."""
    metrics = dict(train_epoch(trainer, num_steps))
    if validate:
        # val_loss, val_accuracy keep their names; val_num_samples etc. stay apart
        # from the train metrics of the same name.
        for key, value in trainer.validate().items():
            metrics[key if key.startswith("val_") else f"val_{key}"] = value
    metrics["epoch"] = trainer.epoch  # epochs completed, like training_iteration
    metrics["backend"] = trainer.backend_name  # which backend a searched choice ran
    return metrics


def _run_trial(trainer: Any, num_epochs: int | None, validate: bool, num_steps: int | None) -> None:
    """Resume from Tune's checkpoint, then train and report epoch by epoch; shuts down."""
    tune = _tune()
    try:
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                trainer.load(os.path.join(directory, CHECKPOINT_FILE))
                follow_config_changes(trainer, _read_config(directory))
        while num_epochs is None or trainer.epoch < num_epochs:
            metrics = _epoch_metrics(trainer, validate, num_steps)
            with tempfile.TemporaryDirectory(prefix="polytrain_tune_") as directory:
                trainer.save(os.path.join(directory, CHECKPOINT_FILE))
                _write_config(trainer, directory)
                # Tune copies the directory into the trial's storage before returning.
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        trainer.shutdown()


def _json_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """``config`` as it reads back from JSON; None when it does not fit into JSON."""
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError):
        return None


def _write_config(trainer: Any, directory: str) -> None:
    config = _json_config(dict(trainer.config))
    if config is not None:
        with open(os.path.join(directory, CONFIG_FILE), "w") as file:
            json.dump(config, file)


def _read_config(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def follow_config_changes(trainer: Any, saved: dict[str, Any] | None) -> dict[str, Any]:
    """After loading a checkpoint written under ``saved`` config: the optimizers take the trainer's.

    A checkpoint restores the optimizers' state, hyperparameters included, so a PBT
    exploit that mutates ``lr`` would otherwise keep training with the lr of the
    trial it cloned. On every worker both configs go through ``optimizer_creator``;
    each hyperparameter they set differently (``lr``, ``momentum``, ``weight_decay``,
    ...) takes the trainer's value. ``lr`` is scaled by new/old instead, and the
    schedulers' base learning rates follow, so a schedule keeps its progress.

    Args:
        trainer: a loaded trainer (its :meth:`follow_config` applies the change).
        saved: the config the checkpoint was written under (None: unknown, no-op).

    Returns:
        The config keys whose values changed (``{key: (old, new)}``).
    """
    current = _json_config(dict(trainer.config))
    if saved is None or current is None:
        return {}
    changed = {
        key: (saved.get(key), value) for key, value in current.items() if saved.get(key) != value
    }
    if changed:
        logger.info("Restored with a changed config %s: the optimizers follow it.", changed)
        trainer.follow_config({key: pair[0] for key, pair in changed.items()})
    return changed


def make_trainable(
    trainer_cls: type,
    *,
    num_epochs: int | None = None,
    validate: bool = True,
    num_steps: int | None = None,
    trainable_resources: dict[str, float] | None = None,
    **trainer_kwargs: Any,
) -> Callable[[dict[str, Any]], None]:
    """A Tune function trainable that trains ``trainer_cls(**trainer_kwargs)`` per trial.

    Each trial merges its config into ``trainer_kwargs`` (see the module docstring
    for the reserved keys), builds the trainer in its placement group, resumes
    from Tune's checkpoint if there is one, and then, once per epoch, calls
    ``train()`` (and ``validate()``) and ``tune.report(metrics, checkpoint=...)``
    with a checkpoint directory holding ``trainer.save()``. Train metrics are
    reported as they are (``loss``, ``num_samples``, ...), validation metrics with a
    ``val_`` prefix (``val_loss``, ``val_accuracy``, ``val_num_samples``, ...);
    ``epoch`` counts completed epochs and ``backend`` names the backend that ran.
    The module docstring has an example.

    Args:
        trainer_cls: :class:`~polytrain.TorchTrainer` or :class:`~polytrain.TFTrainer`.
        num_epochs: stop a trial after this many epochs; None trains until Tune's
            ``stop`` criteria or scheduler stop it.
        validate: call ``validate()`` after each epoch (needs validation data).
        num_steps: train only this many batches per reported "epoch".
        trainable_resources: bundle 0 of the trial's placement group (default 1 CPU).
        **trainer_kwargs: the trainer's arguments, as for ``trainer_cls(...)``.

    Pass ``tune.TuneConfig(reuse_actors=True)`` to let each trial take the previous
    trial's warm workers (see the module docstring).

    Returns:
        A function trainable carrying its per-trial resources (``tune.with_resources``).

    Raises:
        ConfigError: bad ``num_epochs`` or a trainer option Tune cannot reserve for.
    """
    if num_epochs is not None and (
        isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1
    ):
        raise ConfigError(f"num_epochs must be an int >= 1 or None; got {num_epochs!r}.")
    # Fail in the driver, before any trial starts, on options that would fail in every trial.
    _resources_of(trainer_kwargs, trainable_resources)

    def resources(trial_config: dict[str, Any]) -> PlacementGroupFactory:
        return _resources_of(_split_trial_config(trial_config, trainer_kwargs), trainable_resources)

    def train_polytrain(trial_config: dict[str, Any]) -> None:
        trainer = trainer_cls(**_split_trial_config(trial_config, trainer_kwargs))
        _run_trial(trainer, num_epochs, validate, num_steps)

    train_polytrain.__name__ = f"{trainer_cls.__name__}_trainable"
    train_polytrain.__qualname__ = train_polytrain.__name__
    return _tune().with_resources(train_polytrain, resources)
