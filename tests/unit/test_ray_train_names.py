"""Every public name of the installed Ray Train exists in ``polytrain.train``, and the migration guide lists it.

The names come from the installed Ray's ``__all__``\\ s (and ``ray.train.constants``), so
a Ray upgrade that adds a name fails here until polytrain has it and the guide says
what it does. Names whose Ray module cannot be imported here (a framework missing) are
skipped with the reason.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migration" / "ray-train.md"

#: Ray module -> polytrain module with the same names.
MODULES = {
    "ray.train": "polytrain.train",
    "ray.train.torch": "polytrain.train.torch",
    "ray.train.tensorflow": "polytrain.train.tensorflow",
    "ray.train.tensorflow.keras": "polytrain.train.tensorflow.keras",
    "ray.train.horovod": "polytrain.train.horovod",
    "ray.train.lightning": "polytrain.train.lightning",
    "ray.train.collective": "polytrain.train.collective",
    "ray.train.huggingface.transformers": "polytrain.train.huggingface.transformers",
}
#: Ray's ``keras`` module has no ``__all__``: its public classes.
KERAS_NAMES = ("RayReportCallback", "ReportCheckpointCallback")


def _ray_names(module: str) -> list[str]:
    try:
        ray_module = importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} does not import here: {exc}")
    if module.endswith(".keras"):
        return list(KERAS_NAMES)
    return list(ray_module.__all__)


def _polytrain(module: str):
    try:
        return importlib.import_module(MODULES[module])
    except ImportError as exc:
        if "huggingface" in module:
            pytest.skip(f"{MODULES[module]} has not landed in this tree: {exc}")
        raise


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_name_of_ray_train_exists_in_polytrain(module):
    names = _ray_names(module)
    ours = _polytrain(module)
    missing = [name for name in names if not hasattr(ours, name)]
    assert missing == [], f"{MODULES[module]} lacks Ray's {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_migration_guide_lists_every_name_with_its_status(module):
    names = _ray_names(module)
    rows = set(re.findall(r"^\| `([\w.]+)` \| (?:same|Ray 1\.x|refused)", GUIDE.read_text(), re.M))
    unlisted = [f"{module}.{name}" for name in names if f"{module}.{name}" not in rows]
    assert unlisted == []


def test_every_constant_of_ray_train_exists():
    ray_constants = importlib.import_module("ray.train.constants")
    ours = importlib.import_module("polytrain.train.constants")
    names = [n for n in dir(ray_constants) if n.isupper() or n in ("_get_ray_train_session_dir",)]
    assert [n for n in names if not hasattr(ours, n)] == []
    assert ours.TRAIN_DATASET_KEY == ray_constants.TRAIN_DATASET_KEY
    assert ours.RAY_CHDIR_TO_TRIAL_DIR == ray_constants.RAY_CHDIR_TO_TRIAL_DIR


def test_removed_names_raise_on_use_naming_the_replacement():
    from polytrain.train import (
        CheckpointConfig,
        FailureConfig,
        RunConfig,
        ScalingConfig,
        SyncConfig,
        TrainContext,
    )
    from polytrain.train.errors import DeprecatedOptionError

    # Ray Train 2.x raises DeprecationWarning for each of these; so does polytrain, naming
    # what to use (and the error is a polytrain ConfigError, a ValueError).
    cases = [
        (lambda: SyncConfig(), "storage_path"),
        (lambda: RunConfig(verbose=0), "Tuner"),
        (lambda: FailureConfig(fail_fast=True), "max_failures"),
        (lambda: ScalingConfig(trainer_resources={"CPU": 1}), "driver"),
        (lambda: CheckpointConfig(checkpoint_frequency=2), "reports checkpoints"),
        (lambda: TrainContext(0, 1, 0, 1, 0, "x").get_metadata(), "train_loop_config"),
    ]
    for make, hint in cases:
        with pytest.raises(DeprecationWarning, match=hint) as info:
            make()
        assert isinstance(info.value, (DeprecatedOptionError, ValueError))
