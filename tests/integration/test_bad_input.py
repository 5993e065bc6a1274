"""The bad-input table: every row fails clearly (value, what is allowed, what to do) and leaves
no actor or placement group behind. docs/failures.md documents the same table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends import registry
from polytrain.compat.imports import MissingDependencyError
from polytrain.errors import (
    ConfigError,
    ConfigTypeError,
    CreatorError,
    InsufficientResourcesError,
    WorkerError,
)
from tests.helpers import DIGITS

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus", "no_leftover_actors")

CONFIG = {"lr": 0.1, "batch_size": 16}


def _trainer(**overrides):
    kwargs = {**DIGITS, "config": CONFIG, "num_workers": 2, **overrides}
    return TorchTrainer(**kwargs)


def test_unknown_backend():
    with pytest.raises(
        ValueError, match=r"Unknown backend 'pytorch_ddp'\. Valid names: 'ddp'"
    ) as info:
        _trainer(backend="pytorch_ddp")
    assert isinstance(info.value, ConfigError)


def test_backend_not_installed():
    spec = registry.BackendSpec(
        "absent",
        "polytrain.backends.ddp.backend:DDPBackend",
        "torch",
        "needs a missing package",
        requires=("a_package_that_is_not_installed",),
    )
    registry.register_backend(spec)
    try:
        with pytest.raises(
            MissingDependencyError, match="Backend 'absent' needs .*Install it with"
        ):
            _trainer(backend="absent")
    finally:
        registry._SPECS.pop("absent")
        registry._ALIASES.pop("absent")


def test_backend_of_the_wrong_framework():
    with pytest.raises(ValueError, match="'mwms' is a tensorflow backend.*Use TFTrainer") as info:
        _trainer(backend="mwms")
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [(-1, "num_workers must be >= 0; got -1"), ("2", "num_workers must be an int >= 0; got str")],
)
def test_bad_num_workers(value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _trainer(num_workers=value)


def test_gpu_requested_without_gpus_in_the_cluster():
    with pytest.raises(InsufficientResourcesError, match=r"0 GPU in total.*Set use_gpu=False"):
        _trainer(use_gpu=True)


def test_batch_size_smaller_than_num_workers():
    with pytest.raises(
        ConfigError, match=r"batch_size'\]=1 is the global batch and must be at least num_workers=2"
    ):
        _trainer(config={"batch_size": 1})


def test_creator_not_callable():
    with pytest.raises(CreatorError, match="optimizer_creator must be callable.*got str"):
        _trainer(optimizer_creator="sgd")


def test_creator_with_wrong_arguments():
    with pytest.raises(CreatorError, match=r"model_creator .*cannot be called with 1 argument"):
        _trainer(model_creator=lambda: torch.nn.Linear(64, 10))


def test_creator_returning_the_wrong_type():
    with pytest.raises(
        WorkerError,
        match="(?s)optimizer_creator returned Sequential .*expected a torch.optim.Optimizer",
    ):
        _trainer(optimizer_creator=lambda model, config: model)


def test_data_loader_with_zero_batches():
    def empty_data(config):
        data = TensorDataset(torch.zeros(3, 64), torch.zeros(3).long())
        return DataLoader(data, batch_size=config["batch_size"], drop_last=True)

    with pytest.raises(
        WorkerError, match=r"training data loader of rank \d has no batches .*drop_last=True"
    ):
        _trainer(data_creator=empty_data)


class NaNAtStep3(TrainingOperator):
    def train_batch(self, batch, batch_info):
        metrics = super().train_batch(batch, batch_info)
        if batch_info["batch_idx"] == 3 and self.world_rank == 1:
            metrics["loss"] = float("nan")
        return metrics


def test_nan_loss_fails_fast_with_step_and_rank_and_can_be_disabled():
    trainer = _trainer(training_operator_cls=NaNAtStep3)
    with pytest.raises(
        WorkerError,
        match=r"Loss became nan at epoch 0, step 3 .* on rank 1.*check_finite_loss=False",
    ):
        trainer.train()
    trainer = _trainer(training_operator_cls=NaNAtStep3, check_finite_loss=False)
    try:
        assert trainer.train()["num_steps"] > 3
    finally:
        trainer.shutdown()


def test_config_file_with_unknown_keys_and_wrong_types(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "model: examples.digits:model_creator\ndata: examples.digits:data_creator\n"
        "optimizer: examples.digits:optimizer_creator\nloss: examples.digits:loss_creator\n"
        "num_workers: two\nscaling: {num_wokers: 2}\n"
    )
    with pytest.raises(
        Exception, match=r"(?s)num_workers.*scaling\.num_wokers: unknown key"
    ) as info:
        TorchTrainer.from_config(path)
    assert "num_workers" in str(info.value)
    # Only unknown keys and wrong types: a TypeError as well as a ConfigError.
    assert isinstance(info.value, ConfigTypeError)


def test_unreachable_ray_address(tmp_path):
    # A fresh driver (no Ray yet in that process) pointed at a port nobody listens on.
    code = (
        "import torch\n"
        "from polytrain import TorchTrainer\n"
        "from tests.helpers import DIGITS\n"
        "try:\n"
        "    TorchTrainer(**DIGITS, config={'batch_size': 8},\n"
        "                 scaling_config={'num_workers': 2, 'address': '127.0.0.1:9'})\n"
        "except ConnectionError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "ERROR Could not connect to Ray at address='127.0.0.1:9'" in result.stdout, (
        result.stderr[-2000:]
    )
    assert "address=None to start a local instance" in result.stdout
