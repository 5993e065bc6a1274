"""Ray Train 2.60's Accelerate cases (``ray/train/tests/test_torch_accelerate.py``) on polytrain.

The same cases and assertions, with ``ray.train`` replaced by ``polytrain.train``.
What differs, and why:

- Ray's ``LinearDataset`` (from its examples) is defined here;
- DeepSpeed's optimizer is imported only when a DeepSpeed plugin is active (Ray
  imports it in every case, which only costs time);
- Ray's ``ray_2_node_2_gpu`` / ``ray_start_4_cpus`` fixtures are the suite's shared
  Ray instance; the GPU cases (``use_gpu=True``, DeepSpeed) need GPUs.
"""

from __future__ import annotations

import copy
import os
from tempfile import TemporaryDirectory

import pytest
import torch
import torch.nn as nn

import polytrain.train as train
from polytrain.train import Checkpoint, ScalingConfig
from polytrain.train.torch import TorchTrainer
from tests.conftest import cuda_available

accelerate = pytest.importorskip("accelerate")
Accelerator = accelerate.Accelerator

DEEPSPEED_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
    },
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

needs_gpus = pytest.mark.skipif(not cuda_available(), reason="needs 2 GPUs")


@pytest.fixture
def ray_2_node_2_gpu(ray_start_4_cpus):
    return ray_start_4_cpus


class LinearDataset(torch.utils.data.Dataset):
    """y = a * x + b on ``size`` points of [0, 10) (Ray's example data set)."""

    def __init__(self, a: float, b: float, size: int = 1000) -> None:
        x = torch.arange(0, 10, 10 / size, dtype=torch.float32)
        self.x, self.y = x.unsqueeze(1), (a * x + b).unsqueeze(1)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def _optimizer_class(accelerator):
    plugin = accelerator.state.deepspeed_plugin
    if plugin and "optimizer" in plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        return DummyOptim
    if plugin:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam
    return torch.optim.SGD


def linear_train_func(accelerator, config):
    batch_size = config.get("batch_size", 32)
    train_loader = torch.utils.data.DataLoader(
        LinearDataset(2, 5, size=config.get("data_size", 1000)), batch_size=batch_size
    )
    validation_loader = torch.utils.data.DataLoader(
        LinearDataset(2, 5, size=config.get("val_size", 400)), batch_size=batch_size
    )
    model = nn.Linear(1, config.get("hidden_size", 1))
    loss_fn = nn.MSELoss()
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = _optimizer_class(accelerator)(groups, lr=config.get("lr", 1e-2))
    train_loader, validation_loader, model, optimizer = accelerator.prepare(
        train_loader, validation_loader, model, optimizer
    )
    results = []
    for _ in range(config.get("epochs", 3)):
        for x, y in train_loader:
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            loss = sum(loss_fn(model(x), y).item() for x, y in validation_loader)
        loss /= len(validation_loader)
        state_dict = copy.deepcopy(accelerator.unwrap_model(model)).cpu().state_dict()
        results.append({"loss": loss})
        with TemporaryDirectory() as tmpdir:
            torch.save(state_dict, os.path.join(tmpdir, "checkpoint.pt"))
            train.report({"loss": loss}, checkpoint=Checkpoint.from_directory(tmpdir))
    return results


def _fit(train_func, config=None, **scaling):
    TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(**scaling),
    ).fit()


@pytest.mark.parametrize("use_gpu", [pytest.param(True, marks=needs_gpus), False])
def test_accelerate_base(ray_2_node_2_gpu, use_gpu):
    epochs = 3

    def train_func(config):
        accelerator = Accelerator(cpu=not use_gpu)
        assert accelerator.device == train.torch.get_device()
        assert accelerator.process_index == train.get_context().get_world_rank()
        if accelerator.device.type != "cpu":
            assert accelerator.local_process_index == train.get_context().get_local_rank()
        result = linear_train_func(accelerator, config)
        assert len(result) == epochs
        assert result[-1]["loss"] < result[0]["loss"]

    config = {"lr": 1e-2, "hidden_size": 1, "batch_size": 4, "epochs": epochs}
    _fit(train_func, config, num_workers=2, use_gpu=use_gpu)


@needs_gpus
def test_accelerate_deepspeed(ray_2_node_2_gpu):
    epochs = 3

    def train_func(config):
        plugin = accelerate.DeepSpeedPlugin(hf_ds_config=DEEPSPEED_CONFIG)
        accelerator = Accelerator(deepspeed_plugin=plugin)
        assert accelerator.device == train.torch.get_device()
        assert accelerator.process_index == train.get_context().get_world_rank()
        assert accelerator.local_process_index == train.get_context().get_local_rank()
        result = linear_train_func(accelerator, config)
        assert len(result) == epochs
        assert result[-1]["loss"] < result[0]["loss"]

    config = {"lr": 1e-2, "hidden_size": 1, "batch_size": 4, "epochs": epochs}
    # Ray's DeepSpeed plugin on a plain (ddp) group: polytrain's deepspeed backend says so.
    TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
        backend="deepspeed",
        backend_config={"config": {"zero_optimization": {"stage": 2}}},
    ).fit()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_accelerate_e2e(ray_start_4_cpus, num_workers):
    def train_func():
        accelerator = Accelerator(cpu=True)
        assert accelerator.device == train.torch.get_device()
        assert accelerator.process_index == train.get_context().get_world_rank()
        model = accelerator.prepare(torch.nn.Linear(3, 1))
        with TemporaryDirectory() as tmpdir:
            torch.save(model, os.path.join(tmpdir, "checkpoint.pt"))
            train.report({}, checkpoint=Checkpoint.from_directory(tmpdir))

    _fit(train_func, num_workers=num_workers)
