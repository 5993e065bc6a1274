"""Creators and helpers shared by the tests (kept out of the package)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from examples import digits

PARITY_SAMPLES = 512
PARITY_FEATURES = 16


def parity_dataset() -> TensorDataset:
    """A fixed regression-to-classes data set (generated, seeded)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((PARITY_SAMPLES, PARITY_FEATURES)).astype(np.float32)
    w = rng.standard_normal((PARITY_FEATURES, 4)).astype(np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int64)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def parity_model_creator(config: dict) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(PARITY_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def parity_data_creator(config: dict):
    data = parity_dataset()
    # No shuffling: the distributed sampler's interleaving reproduces the global batch order.
    return DataLoader(data, batch_size=config["batch_size"], shuffle=False), DataLoader(
        data, batch_size=config["batch_size"]
    )


def parity_optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))


def adam_optimizer_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 1e-3))


def plain_reference(steps: int, global_batch: int, lr: float = 0.1) -> torch.nn.Module:
    """The single-process PyTorch loop the distributed runs must reproduce."""
    model = parity_model_creator({})
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(parity_dataset(), batch_size=global_batch, shuffle=False)
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return model


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


DIGITS = {
    "model_creator": digits.model_creator,
    "data_creator": digits.data_creator,
    "optimizer_creator": digits.optimizer_creator,
    "loss_creator": torch.nn.CrossEntropyLoss,
}
