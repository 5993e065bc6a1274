"""Quick start: classify scikit-learn's 8x8 digits (shipped with the package, no download).

Run it:  python examples/digits.py --backend ddp --num-workers 2 --epochs 5

The creators below are what a polytrain user writes; the YAML configs in
examples/configs/ point at them by import path (``examples.digits:model_creator``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

SEED = 0


def load_digits_tensors(test_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """The digits data as standardised float features and integer labels, split train/val."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * (1 - test_fraction))
    train = TensorDataset(torch.from_numpy(x[:split]), torch.from_numpy(y[:split]))
    val = TensorDataset(torch.from_numpy(x[split:]), torch.from_numpy(y[split:]))
    return train, val


def model_creator(config: dict) -> torch.nn.Module:
    """A small MLP, 64 -> hidden -> 10."""
    torch.manual_seed(config.get("seed", SEED))
    hidden = config.get("hidden", 64)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders; ``config["batch_size"]`` is this worker's batch."""
    train, val = load_digits_tensors()
    generator = torch.Generator().manual_seed(config.get("seed", SEED))
    return (
        DataLoader(train, batch_size=config["batch_size"], shuffle=True, generator=generator),
        DataLoader(val, batch_size=config["batch_size"]),
    )


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """SGD with momentum."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)


def scheduler_creator(optimizer: torch.optim.Optimizer, config: dict):
    """Halve the learning rate every few epochs."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.get("lr_step", 3), gamma=0.5)


loss_creator = torch.nn.CrossEntropyLoss


def main() -> None:
    """Train and validate from the command line."""
    from polytrain import TorchTrainer, available_backends

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddp", help=f"one of {available_backends('torch')}")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--checkpoint", default="digits.ckpt.pt")
    args = parser.parse_args()

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=loss_creator,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq="epoch",
        config={"lr": args.lr, "batch_size": args.batch_size},
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        backend=args.backend,
        use_tqdm=True,
    )
    for _ in range(args.epochs):
        stats = trainer.train()
        val = trainer.validate()
        print(
            f"epoch {stats['epoch']}: loss {stats['loss']:.4f}  val_loss {val['val_loss']:.4f}  "
            f"val_accuracy {val['val_accuracy']:.3f}  {stats['samples_per_s']:.0f} samples/s"
        )
    print("checkpoint:", trainer.save(args.checkpoint))
    trainer.shutdown()


if __name__ == "__main__":
    main()
