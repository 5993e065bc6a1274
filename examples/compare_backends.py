"""Compare every installed torch backend on your own creators, from Python.

Run it:  python examples/compare_backends.py --epochs 3 --out polytrain_runs/my-compare

The same as ``polytrain compare -c examples/configs/ddp.yaml``, without a YAML
file: the creators below are a small regression-to-classes job generated with a
fixed seed; put your own in their place. Each backend runs the identical job in
turn (2 workers) and is shut down before the next; backends whose packages are
missing are listed as skipped with the command that installs them.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES, SAMPLES = 32, 4, 4096


def _dataset(seed: int) -> TensorDataset:
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(0).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ weights).argmax(axis=1).astype(np.int64)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def model_creator(config: dict) -> torch.nn.Module:
    """An MLP with ``config["hidden"]`` units."""
    torch.manual_seed(0)
    hidden = config["hidden"]
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders; ``config["batch_size"]`` is this worker's batch."""
    return (
        DataLoader(_dataset(1), batch_size=config["batch_size"], shuffle=True),
        DataLoader(_dataset(2), batch_size=config["batch_size"]),
    )


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """Adam."""
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


def main() -> None:
    """Compare the backends and print the table."""
    from polytrain import available_backends
    from polytrain.compare.runner import compare_backends, default_run_dir, format_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        default=",".join(available_backends("torch")),
        help="comma-separated backend names (default: every installed torch backend)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: ./polytrain_runs/compare-<time>/")
    args = parser.parse_args()

    out = args.out or default_run_dir("compare")
    results = compare_backends(
        {
            "model_creator": model_creator,
            "data_creator": data_creator,
            "optimizer_creator": optimizer_creator,
            "loss_creator": torch.nn.CrossEntropyLoss,
            "config": {"lr": 1e-3, "batch_size": 128, "hidden": 128},
            "num_workers": args.num_workers,
        },
        backends=args.backends.split(","),
        epochs=args.epochs,
        out_dir=out,
    )
    print()
    print(format_table(results))
    print(f"\nCSV, JSON and plot in {out}/")


if __name__ == "__main__":
    main()
