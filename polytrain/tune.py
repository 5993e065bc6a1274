"""Ray Tune integration: trainables built from polytrain trainers, and their placement groups.

The public face of :mod:`polytrain.trainer_api.trainable`, where the code lives
(so that ``BaseTrainer.as_trainable`` imports nothing above ``trainer_api``);
see that module for how trial configs map to trainer options and for an example.
The Lightning side (``TuneReportCallback``) is in :mod:`polytrain.lightning`.

``ray.tune`` is imported only when a trainable or a placement group is built.
"""

from __future__ import annotations

from polytrain.trainer_api.trainable import (
    CHECKPOINT_FILE,
    TRAINER_OPTION_KEYS,
    make_trainable,
    tune_resources,
)

# The trial-config helpers stay importable from here, where they were first written.
from polytrain.trainer_api.trainable import _scaling_of as _scaling_of
from polytrain.trainer_api.trainable import _split_trial_config as _split_trial_config

__all__ = ["CHECKPOINT_FILE", "TRAINER_OPTION_KEYS", "make_trainable", "tune_resources"]
