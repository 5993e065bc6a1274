"""Ray Tune integration: trainables built from polytrain trainers, their placement groups, ``Tuner``.

Creator API: ``TorchTrainer.as_trainable(...)`` (the code lives in
:mod:`polytrain.trainer_api.trainable`, so that ``BaseTrainer.as_trainable``
imports nothing above ``trainer_api``; see that module for how trial configs map
to trainer options and for an example). Function API: :class:`Tuner` over a
``polytrain.train`` trainer, as Ray Train's ``Tuner(trainer)`` (the trainable is
in :mod:`polytrain.train.tuning`). The Lightning side (``TuneReportCallback``) is
in :mod:`polytrain.lightning`.

``ray.tune`` is imported only when a trainable, a placement group or a Tuner is built.
"""

from __future__ import annotations

from typing import Any

from polytrain.compat.imports import require
from polytrain.trainer_api.trainable import (
    CHECKPOINT_FILE,
    TRAINER_OPTION_KEYS,
    make_trainable,
    tune_resources,
)

# The trial-config helpers stay importable from here, where they were first written.
from polytrain.trainer_api.trainable import _scaling_of as _scaling_of
from polytrain.trainer_api.trainable import _split_trial_config as _split_trial_config

__all__ = ["CHECKPOINT_FILE", "TRAINER_OPTION_KEYS", "Tuner", "make_trainable", "tune_resources"]


def _is_loop_trainer(trainable: Any) -> bool:
    from polytrain.train.trainer import DataParallelTrainer

    return isinstance(trainable, DataParallelTrainer)


def _default_run_config(tune: Any, trainer: Any) -> Any:
    """The Tuner's RunConfig from the trainer's (name, storage), as Ray Train does without one."""
    from polytrain.train.config import DEFAULT_STORAGE_PATH

    run = trainer.run_config
    storage = run.storage_path or DEFAULT_STORAGE_PATH
    if "://" not in str(storage):
        import os

        storage = os.path.abspath(os.path.expanduser(storage))
    return tune.RunConfig(name=run.name, storage_path=storage)


class Tuner:
    """``ray.tune.Tuner`` that also takes a ``polytrain.train`` trainer (Ray Train's ``Tuner(trainer)``).

    A function-API trainer (``polytrain.train.torch.TorchTrainer(loop, ...)``,
    ``HorovodTrainer``, ``TensorflowTrainer``) becomes ``trainer.as_trainable()``:
    every trial runs the loop on its own worker group inside the trial's placement
    group, ``report()`` calls become trial results and reported checkpoints the
    trial's checkpoints (see :mod:`polytrain.train.tuning`). ``param_space`` takes
    ``"train_loop_config"`` (merged into the trainer's) and ``"scaling_config"``.
    Without ``run_config`` the trainer's ``name`` and ``storage_path`` are used (its
    ``failure_config`` stays the trainer's: restarts of the group inside a trial;
    Tune's ``ray.tune.FailureConfig`` retries whole trials from their checkpoint).
    Anything else (a function, a creator-API trainable) goes to ``ray.tune.Tuner``
    unchanged.

    Args:
        trainable: a ``polytrain.train`` trainer, or any Tune trainable.
        param_space: the search space.
        tune_config: ``ray.tune.TuneConfig`` (metric, mode, scheduler, num_samples).
        run_config: ``ray.tune.RunConfig`` (name, storage_path, callbacks, failures).
        **kwargs: more ``ray.tune.Tuner`` arguments.

    Example::

        trainer = TorchTrainer(train_loop, train_loop_config={"epochs": 3},
                               scaling_config=ScalingConfig(num_workers=2))
        tuner = Tuner(trainer,
                      param_space={"train_loop_config": {"lr": tune.grid_search([0.01, 0.1])}},
                      tune_config=tune.TuneConfig(metric="loss", mode="min"))
        best = tuner.fit().get_best_result()

    Raises:
        ConfigError: a ``param_space`` key the trainer does not take.
    """

    def __init__(
        self,
        trainable: Any = None,
        *,
        param_space: dict[str, Any] | None = None,
        tune_config: Any = None,
        run_config: Any = None,
        **kwargs: Any,
    ) -> None:
        tune = require("ray.tune", "polytrain.tune.Tuner")
        if _is_loop_trainer(trainable):
            from polytrain.train.tuning import check_param_space

            check_param_space(param_space)
            if run_config is None:
                run_config = _default_run_config(tune, trainable)
            trainable = trainable.as_trainable()
        self._tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune_config,
            run_config=run_config,
            **kwargs,
        )

    def fit(self) -> Any:
        """Run every trial; the ``ray.tune.ResultGrid``."""
        return self._tuner.fit()

    def get_results(self) -> Any:
        """The ``ray.tune.ResultGrid`` of the last ``fit()`` (or of a restored experiment)."""
        return self._tuner.get_results()

    @classmethod
    def restore(cls, path: str, trainable: Any, **kwargs: Any) -> Tuner:
        """Resume an interrupted experiment at ``path`` (``ray.tune.Tuner.restore``).

        ``trainable`` is the same trainer (or trainable) the experiment ran.
        """
        tune = require("ray.tune", "polytrain.tune.Tuner")
        if _is_loop_trainer(trainable):
            trainable = trainable.as_trainable()
        tuner = cls.__new__(cls)
        tuner._tuner = tune.Tuner.restore(path, trainable, **kwargs)
        return tuner

    @staticmethod
    def can_restore(path: str) -> bool:
        """Whether ``path`` holds an experiment :meth:`restore` can resume."""
        return require("ray.tune", "polytrain.tune.Tuner").Tuner.can_restore(path)
