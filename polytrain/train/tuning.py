"""The function API under Ray Tune: one ``fit()`` of the trainer's loop per trial.

``trainer.as_trainable()`` (what :class:`polytrain.tune.Tuner` calls) returns a
Tune function trainable. Every trial:

* copies the trainer with the trial's config: ``param_space={"train_loop_config":
  {...}}`` entries update the trainer's ``train_loop_config`` (Ray Train's
  merge), ``"scaling_config"`` (a dict of fields, or a ``ScalingConfig``) updates
  or replaces its scaling;
* reserves a placement group of one bundle for the trial's own process
  (``{"CPU": 1}``, Ray Train's default ``trainer_resources``) and one per worker,
  which the trial's worker group fills, so parallel trials never oversubscribe;
* runs the loop in the trial's storage (``<trial dir>/polytrain_run``); each of
  rank 0's reports reaches Tune as a trial result (``tune.report``), with its
  committed checkpoint, which Tune copies into the trial's own
  ``checkpoint_NNNNNN``; the run keeps only the newest copy of its own, for
  restarts of the group inside the trial;
* when Tune restores the trial (a retried failure, PBT, a resumed experiment),
  starts a fresh run whose ``get_checkpoint()`` returns Tune's checkpoint.

``ray.tune`` is imported only when a trainable is built.
"""

from __future__ import annotations

from typing import Any

from polytrain.checkpoint.storage import Storage
from polytrain.compat.imports import require
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import ScalingConfig
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.feed import public

# A trainer is a polytrain.train.trainer.DataParallelTrainer, which imports this module
# (as_trainable): not imported here, even for typing, so no import circle.
DataParallelTrainer = Any

#: The ``param_space`` keys a function-API trainer takes (Ray Train's names).
PARAM_KEYS = ("train_loop_config", "scaling_config")
#: The trial's run, below the trial's directory in Tune's storage.
RUN_DIR = "polytrain_run"


def check_param_space(param_space: Any) -> None:
    """Refuse ``param_space`` keys a function-API trainer does not take.

    Raises:
        ConfigTypeError: not a dict, or ``train_loop_config`` not a dict.
        ConfigError: another key.
    """
    if param_space is None:
        return
    if not isinstance(param_space, dict):
        raise ConfigTypeError(
            f"param_space must be a dict; got {type(param_space).__name__}: {param_space!r}."
        )
    unknown = sorted(set(param_space) - set(PARAM_KEYS))
    if unknown:
        raise ConfigError(
            f"param_space keys {unknown} are not trainer arguments Tune can set; allowed: "
            f"{list(PARAM_KEYS)}. Put the loop's hyperparameters under 'train_loop_config', "
            f"e.g. param_space={{'train_loop_config': {{'lr': tune.grid_search([...])}}}}."
        )
    loop_config = param_space.get("train_loop_config", {})
    if not isinstance(loop_config, dict):
        raise ConfigTypeError(
            f"param_space['train_loop_config'] must be a dict of the loop's hyperparameters; "
            f"got {type(loop_config).__name__}: {loop_config!r}."
        )


def _trial(trainer: DataParallelTrainer, trial_config: dict[str, Any]) -> DataParallelTrainer:
    check_param_space(trial_config)
    return trainer.for_trial(
        dict(trial_config.get("train_loop_config") or {}), trial_config.get("scaling_config")
    )


def trial_resources(scaling: ScalingConfig) -> Any:
    """The trial's placement group: ``{"CPU": 1}`` for the trial, then one bundle per worker.

    Raises:
        ConfigError: local mode (``num_workers=0``), which has no workers to place.
    """
    from polytrain.trainer_api.trainable import placement_group_factory

    return placement_group_factory(scaling)


def _url_of(checkpoint: Any) -> str:
    """A polytrain location (path or fsspec URL) of a ``ray.tune.Checkpoint``."""
    kind = getattr(checkpoint.filesystem, "type_name", "local")
    return checkpoint.path if kind == "local" else f"{kind}://{checkpoint.path}"


def _trial_storage(tune: Any) -> str:
    """The trial's directory in Tune's storage (what every node can reach), as a URL."""
    try:
        storage = tune.get_context().get_storage()
        kind = storage.storage_filesystem.type_name
        path = storage.trial_fs_path
    except (AttributeError, RuntimeError):  # an older Tune: the trial's local directory
        return tune.get_context().get_trial_dir()
    return path if kind == "local" else f"{kind}://{path}"


class TuneSink:
    """Reports each of rank 0's reports to Tune, with its committed checkpoint."""

    def __init__(self, tune: Any, trainer: DataParallelTrainer) -> None:
        self.tune = tune
        self.trainer = trainer

    def __call__(self, entry: dict[str, Any]) -> None:
        url = entry.get("_checkpoint")
        checkpoint = self.tune.Checkpoint(url) if url else None
        self.tune.report(public(entry), checkpoint=checkpoint)  # Tune has copied it now
        if url:
            self.trainer._board_call("release_before", entry["_index"])


def run_trial(trainer: DataParallelTrainer, trial_config: dict[str, Any]) -> None:
    """Tune's side of one trial: the trial's trainer, fed back into Tune report by report."""
    tune = require("ray.tune", "Ray Tune trainables")
    trial = _trial(trainer, trial_config)
    context = tune.get_context()
    trial_root = Storage(_trial_storage(tune))
    if trial_root.exists(RUN_DIR):
        trial_root.remove(RUN_DIR)  # a restored trial starts from Tune's checkpoint, not ours
    trial.run_url = trial_root.child(RUN_DIR).url
    trial.trial_name = context.get_trial_name()
    trial.name = context.get_experiment_name()
    restored = tune.get_checkpoint()
    if restored is not None:
        trial.resume_from_checkpoint = Checkpoint(_url_of(restored))
    trial.add_report_sink(TuneSink(tune, trial))
    trial.fit()


def make_loop_trainable(trainer: DataParallelTrainer) -> Any:
    """A Tune function trainable running ``trainer``'s loop once per trial (module docstring).

    Raises:
        ConfigError: a trainer that cannot run as a trial (local mode).
    """
    tune = require("ray.tune", "Ray Tune trainables")
    trial_resources(trainer.scaling_config)  # fail in the driver, not in every trial

    def resources(trial_config: dict[str, Any]) -> Any:
        return trial_resources(_trial(trainer, trial_config).scaling_config)

    def train_loop_trainable(trial_config: dict[str, Any]) -> None:
        run_trial(trainer, trial_config)

    name = f"{type(trainer).__name__}_trainable"
    train_loop_trainable.__name__ = train_loop_trainable.__qualname__ = name
    return tune.with_resources(train_loop_trainable, resources)
