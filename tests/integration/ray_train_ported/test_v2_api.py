"""Ray Train's ``v2/tests/test_v2_api.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same tests: the options Ray Train 2.x removed raise ``DeprecationWarning`` and the
defaults construct; ``ScalingConfig.total_resources``; ``restore`` / ``can_restore``
are refused; trainers captured in a Ray task deserialize without import circles.

Not applicable: ``test_train_v2_import`` (Ray's switch between its 1.x and 2.x
classes, ``RAY_TRAIN_V2_ENABLED``: polytrain has one set). ``test_serialized_imports``
captures the torch and TensorFlow trainers (polytrain has no XGBoost / LightGBM trainers).
"""

from __future__ import annotations

import pytest
import ray

from polytrain.train import DataParallelTrainer, FailureConfig, RunConfig, ScalingConfig


@pytest.mark.parametrize(
    ("operation", "raise_error"),
    [
        (lambda: FailureConfig(fail_fast=True), True),
        (lambda: RunConfig(verbose=0), True),
        (lambda: FailureConfig(), False),
        (lambda: RunConfig(), False),
        (lambda: ScalingConfig(trainer_resources={"CPU": 1}), True),
        (lambda: ScalingConfig(), False),
    ],
)
def test_api_configs(operation, raise_error):
    if raise_error:
        with pytest.raises(DeprecationWarning):
            operation()
    else:
        operation()


def test_scaling_config_total_resources():
    scaling_config = ScalingConfig(
        num_workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 1}
    )
    assert scaling_config.total_resources == {"CPU": 2, "GPU": 2}


def test_trainer_restore():
    with pytest.raises(DeprecationWarning):
        DataParallelTrainer.restore("dummy")
    with pytest.raises(DeprecationWarning):
        DataParallelTrainer.can_restore("dummy")


def test_serialized_imports(ray_start_4_cpus):
    from polytrain.train.tensorflow import TensorflowTrainer
    from polytrain.train.torch import TorchTrainer

    @ray.remote(num_cpus=0)
    def dummy_task():
        _ = (TorchTrainer, TensorflowTrainer)

    ray.get(dummy_task.remote())


@pytest.mark.skip(reason="Ray-internal: RAY_TRAIN_V2_ENABLED switches Ray's own 1.x/2.x classes")
def test_train_v2_import():
    pass
