"""Ray Train's ``v2/tests/test_torch_trainer.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same tests: a loop that does nothing, and a linear regression trained with the torch
helpers on one and two workers whose loss must fall over three epochs.

Fixture changes: the session's shared Ray instance (tests/conftest.py) instead of a
module-level ``ray.init``; Ray's health-check interval fixture dropped (Ray-internal).
Ray's example ``torch_linear_example.train_func`` is written here as :func:`linear_train_func`
(the same model, data and loop shape).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from polytrain import train
from polytrain.train import Checkpoint, ScalingConfig
from polytrain.train.torch import TorchTrainer

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")


class LinearDataset(torch.utils.data.Dataset):
    """y = a * x + b for x evenly spaced in [0, 10) (Ray's example data)."""

    def __init__(self, a: float, b: float, size: int) -> None:
        self.x = torch.arange(size, dtype=torch.float32).unsqueeze(1) * (10 / size)
        self.y = a * self.x + b

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def linear_train_func(config: dict) -> list[dict]:
    """Fit ``Linear(1, hidden)`` to the line; report the validation loss and a checkpoint per epoch."""
    batch_size = config.get("batch_size", 32)  # per worker, as in Ray's example
    train_loader = train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(LinearDataset(2, 5, 1000), batch_size=batch_size)
    )
    val_loader = train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(LinearDataset(2, 5, 400), batch_size=batch_size)
    )
    model = train.torch.prepare_model(torch.nn.Linear(1, config.get("hidden_size", 1)))
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
    results = []
    for epoch in range(config.get("epochs", 3)):
        if train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        with torch.no_grad():
            losses = [loss_fn(model(x), y).item() for x, y in val_loader]
        result = {"loss": sum(losses) / len(losses)}
        with tempfile.TemporaryDirectory() as directory:
            torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
            train.report(result, checkpoint=Checkpoint.from_directory(directory))
        results.append(result)
    return results


def test_minimal():
    def train_func():
        pass

    trainer = TorchTrainer(train_func)
    trainer.fit()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_torch_linear(num_workers):
    epochs = 3

    def train_func(config):
        result = linear_train_func(config)
        assert len(result) == epochs
        assert result[-1]["loss"] < result[0]["loss"]

    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={"lr": 1e-2, "hidden_size": 1, "batch_size": 4, "epochs": epochs},
        scaling_config=ScalingConfig(num_workers=num_workers),
    )
    trainer.fit()
