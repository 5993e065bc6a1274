"""Ray Data input on real workers: TorchTrainer(datasets=...) split with streaming_split (issue 16.2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer
from polytrain.errors import ConfigError, ConfigTypeError, CreatorError, WorkerError

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

# Every test starts with an empty warm pool: Ray Data's read tasks need the CPUs idle pooled workers would hold.
KEEP_WARM_POOL = False

CONFIG = {"lr": 0.3, "batch_size": 64}
EPOCHS = 3


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def model_creator(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config["lr"])


def loader_creator(config):
    x, y = _digits()
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return (
        DataLoader(data, batch_size=config["batch_size"], shuffle=True),
        DataLoader(data, batch_size=config["batch_size"]),
    )


def _train(**data) -> list[dict]:
    trainer = TorchTrainer(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config=CONFIG,
        num_workers=2,
        **data,
    )
    try:
        stats = [trainer.train() for _ in range(EPOCHS)]
        stats.append(trainer.validate())
        return stats
    finally:
        trainer.shutdown()


def _items() -> list[dict]:
    x, y = _digits()
    return [{"x": row, "y": label} for row, label in zip(x, y, strict=True)]


@pytest.fixture(scope="module")
def reference():
    """The DataLoader path: the same model, data, batch and epochs."""
    return _train(data_creator=loader_creator)


def test_a_ray_dataset_trains_like_the_dataloader_path(reference):
    import ray

    dataset = ray.data.from_items(_items())
    stats = _train(datasets={"train": dataset, "val": dataset})
    x, _ = _digits()
    per_worker_batch = CONFIG["batch_size"] // 2
    # streaming_split(equal=True): each worker gets half the rows, batched at the
    # per-worker batch; full batches only, so both workers take the same steps.
    assert stats[0]["num_steps"] == (len(x) // 2) // per_worker_batch
    assert stats[0]["num_samples"] == stats[0]["num_steps"] * per_worker_batch * 2
    losses, expected = [s["loss"] for s in stats[:EPOCHS]], [s["loss"] for s in reference[:EPOCHS]]
    assert losses[-1] < losses[0] * 0.5, (losses, expected)  # it trained
    assert losses[-1] == pytest.approx(expected[-1], rel=0.25), (
        losses,
        expected,
    )  # as the DataLoader path did
    assert stats[-1]["num_samples"] == len(x)  # validation sees every row once
    assert stats[-1]["val_accuracy"] == pytest.approx(reference[-1]["val_accuracy"], abs=0.08)


def test_a_parquet_file_trains_through_read_parquet(reference, tmp_path):
    import ray

    # two files, as a small data set is stored: from_items' default of 200 blocks would
    # write 200 files and make every epoch 200 read tasks on a 2-core machine
    ray.data.from_items(_items(), override_num_blocks=2).write_parquet(str(tmp_path / "digits"))
    dataset = ray.data.read_parquet(str(tmp_path / "digits"))
    stats = _train(datasets={"train": dataset, "val": dataset})
    assert stats[EPOCHS - 1]["loss"] == pytest.approx(reference[EPOCHS - 1]["loss"], rel=0.25)


def test_bad_datasets_are_refused_before_any_worker_starts():
    import ray

    dataset = ray.data.from_items(_items()[:8])
    common = {
        "model_creator": model_creator,
        "optimizer_creator": optimizer_creator,
        "loss_creator": torch.nn.CrossEntropyLoss,
        "config": CONFIG,
        "num_workers": 2,
    }
    with pytest.raises(ConfigError, match="'train' required"):
        TorchTrainer(**common, datasets={"valid": dataset})
    with pytest.raises(ConfigTypeError, match=r"datasets\['train'\] must be a ray.data.Dataset"):
        TorchTrainer(**common, datasets={"train": loader_creator})
    with pytest.raises(ConfigError, match="Both data_creator and datasets"):
        TorchTrainer(**common, datasets={"train": dataset}, data_creator=loader_creator)


def test_a_dataset_returned_by_data_creator_says_to_pass_it_to_the_trainer():
    import ray

    def creator(config):
        return ray.data.from_items([{"x": 1.0, "y": 0}])

    with pytest.raises((CreatorError, WorkerError), match="datasets="):
        TorchTrainer(
            model_creator=model_creator,
            data_creator=creator,
            optimizer_creator=optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config=CONFIG,
            num_workers=2,
        )
