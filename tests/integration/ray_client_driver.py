"""A driver for test_ray_client.py: trains digits with TorchTrainer through Ray Client.

Usage: ``python ray_client_driver.py ray://127.0.0.1:PORT``

The creators are defined here, in ``__main__``: Ray Client ships them to the
workers by value. Prints one JSON line: the epoch's stats, the validation
metrics, whether this process was connected as a Ray Client, its pid and the workers'.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's 8x8 digits: train and validation loaders."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    train, val = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
    return (
        DataLoader(train, batch_size=config["batch_size"], shuffle=True),
        DataLoader(val, batch_size=config["batch_size"]),
    )


def model_creator(config: dict) -> torch.nn.Module:
    """A small MLP."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """SGD with momentum."""
    return torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)


def main() -> int:
    """Train one epoch on 2 workers at the Ray Client address in argv[1]; print the results."""
    import ray

    from polytrain import TorchTrainer

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=2,
        # The proxy starts a server process for this client first: on 2 busy cores that
        # can take longer than the default 30 s to connect.
        scaling_config={"address": sys.argv[1], "start_timeout_s": 120},
    )
    try:
        stats = trainer.train()
        val = trainer.validate()
        client = ray.util.client.ray.is_connected()
        pids = trainer.apply_all_workers(os.getpid)
    finally:
        trainer.shutdown()
    result = {"stats": stats, "val": val, "client": client, "worker_pids": pids}
    result["driver_pid"] = os.getpid()
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
