"""The seed programs as examples: each trains for real on 2 Ray workers, on tiny generated data.

RaySGD's CIFAR10 + ResNet18 (examples/cifar_resnet.py), Ray Train's two Keras CNNs
(examples/keras_cnns.py) and the Ray Lightning article's LightningMNISTClassifier
(examples/lightning_mnist.py). The examples' own creators are imported and trained by
trainers built in this process (no subprocesses); one epoch each.
"""

from __future__ import annotations

import math

import pytest
import torch

from examples import cifar_resnet, keras_cnns
from polytrain import TFTrainer, TorchTrainer

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus", "no_leftover_actors")

# 64 training and 32 validation images, 4 steps of 8 images a worker.
CIFAR_CONFIG = {"lr": 0.05, "batch_size": 16, "num_train": 64, "num_val": 32}


def _cifar_trainer(model_creator, backend: str = "ddp", **config) -> TorchTrainer:
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=cifar_resnet.data_creator,
        optimizer_creator=cifar_resnet.optimizer_creator,
        loss_creator=cifar_resnet.loss_creator,
        scheduler_creator=cifar_resnet.scheduler_creator,
        scheduler_step_freq="epoch",
        config={**CIFAR_CONFIG, **config},
        num_workers=2,
        backend=backend,
    )


def _small_cnn(config: dict) -> torch.nn.Module:
    # Stands in for resnet18 where torchvision cannot be imported: same input, same head.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )


def test_cifar_creators_train_with_a_small_cnn():
    """The example's data, optimizer, schedule and loss on 2 workers, without torchvision."""
    trainer = _cifar_trainer(_small_cnn, num_train=256)  # 16 steps a worker
    try:
        before = trainer.validate()
        stats = trainer.train()
        after = trainer.validate()
    finally:
        trainer.shutdown()
    assert math.isfinite(stats["loss"]), stats
    assert after["val_loss"] < before["val_loss"], (before, after)


@pytest.mark.parametrize(
    "backend",
    [
        "ddp",
        pytest.param("horovod", marks=pytest.mark.long_matrix),
        pytest.param("fairscale", marks=pytest.mark.long_matrix),
        pytest.param("fsdp", marks=pytest.mark.long_matrix),
        pytest.param("deepspeed", marks=pytest.mark.long_matrix),
    ],
)
def test_cifar_resnet18_trains_on_two_workers(backend):
    """The example's own ResNet-18 (torchvision's where it imports), one epoch on 2 workers."""
    initial = cifar_resnet.model_creator(CIFAR_CONFIG)
    trainer = _cifar_trainer(cifar_resnet.model_creator, backend)
    try:
        stats = trainer.train()
        val = trainer.validate()
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert math.isfinite(stats["loss"]) and math.isfinite(val["val_loss"]), (stats, val)
    assert stats["num_steps"] == 4 and 0.0 <= val["val_accuracy"] <= 1.0
    assert type(model).__name__ in ("ResNet", "ResNet18") and model.fc.out_features == 10
    assert sum(p.numel() for p in model.parameters()) == 11_181_642  # ResNet-18, 10 classes
    assert not torch.equal(model.conv1.weight, initial.conv1.weight)  # it trained


def _train_keras(model_creator, data_creator, config: dict) -> tuple[dict, dict]:
    trainer = TFTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        config=config,
        num_workers=2,
        backend="mwms",
    )
    try:
        return trainer.train(), trainer.validate()
    finally:
        trainer.shutdown()


def test_keras_mnist_cnn_learns_under_mwms():
    stats, val = _train_keras(
        keras_cnns.mnist_cnn_creator,
        keras_cnns.mnist_data_creator,
        {"batch_size": 32, "num_train": 256, "num_val": 128},
    )
    assert math.isfinite(stats["loss"]), stats
    assert val["val_accuracy"] > 0.3, val  # chance: 0.1


def test_keras_224_cnn_trains_under_mwms():
    stats, val = _train_keras(
        keras_cnns.image_cnn_creator,
        keras_cnns.image_data_creator,
        {"batch_size": 8, "num_train": 16, "num_val": 8},
    )
    assert math.isfinite(stats["loss"]) and math.isfinite(val["val_loss"]), (stats, val)


def test_lightning_mnist_classifier_fits_on_ray_strategy(tmp_path, monkeypatch):
    pl = pytest.importorskip("pytorch_lightning")
    from examples.lightning_mnist import LightningMNISTClassifier
    from polytrain.lightning import RayStrategy

    # seed_everything records the seed in PL_* variables; monkeypatch takes them back.
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    pl.seed_everything(0)
    config = {
        "layer_1_size": 32,
        "layer_2_size": 64,
        "lr": 3e-3,
        "batch_size": 32,
        "num_train": 256,
        "num_val": 128,
    }
    trainer = pl.Trainer(
        max_epochs=1,
        strategy=RayStrategy(num_workers=2),
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LightningMNISTClassifier(config))
    metrics = trainer.callback_metrics
    assert math.isfinite(metrics["ptl/train_loss"].item()), metrics
    assert metrics["ptl/val_accuracy"].item() > 0.3, metrics  # chance: 0.1
