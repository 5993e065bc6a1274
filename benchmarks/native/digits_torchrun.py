"""The job of ``examples/configs/ddp.yaml`` as a plain torchrun script: the CLI's baseline.

The same creators (``examples.digits``), DDP on gloo, one epoch with a DistributedSampler;
the model prints the wall-clock time of its first forward on each rank
(``FIRST_FORWARD <unix time>``), here and under ``polytrain train`` (the config's
``model: benchmarks.native.digits_torchrun:timed_model_creator``), so that both launches
are timed the same way from outside (``benchmarks/startup/cli_launch.py``).

Usage: torchrun --nproc_per_node=2 benchmarks/native/digits_torchrun.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from examples import digits

CONFIG = {"lr": 0.1, "batch_size": 64, "hidden": 64, "seed": 0}


class _FirstForwardClock(torch.nn.Module):
    """The digits model, printing the time of its first forward."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen = False

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not self.seen:
            self.seen = True
            print(f"FIRST_FORWARD {time.time()}", flush=True)
        return self.inner(features)


def timed_model_creator(config: dict) -> torch.nn.Module:
    """``examples.digits.model_creator``'s model, printing the time of its first forward."""
    return _FirstForwardClock(digits.model_creator(config))


def main() -> None:
    """One epoch of the digits job under DDP."""
    dist.init_process_group("gloo")
    model = DistributedDataParallel(timed_model_creator(CONFIG))
    train_loader, _ = digits.data_creator(CONFIG)
    loader = DataLoader(
        train_loader.dataset,
        batch_size=CONFIG["batch_size"],
        sampler=DistributedSampler(train_loader.dataset),
    )
    optimizer = digits.optimizer_creator(model, CONFIG)
    loss_fn = torch.nn.CrossEntropyLoss()
    for features, target in loader:
        optimizer.zero_grad()
        loss_fn(model(features), target).backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
