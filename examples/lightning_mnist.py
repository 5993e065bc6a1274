"""A classic MNIST-style LightningModule (Lightning 2.x) trained on Ray actors with any backend.

The module below is plain Lightning: nothing in it knows about polytrain or Ray.
Only the ``strategy=`` argument of the Trainer changes between backends. The data
is scikit-learn's 8x8 digits (shipped with the package, nothing to download).

Run it:  python examples/lightning_mnist.py --backend horovod --num-workers 2 --epochs 3
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
import torchmetrics
from torch.nn import functional as F
from torch.utils.data import DataLoader

from examples.digits import load_digits_tensors


class DigitsClassifier(pl.LightningModule):
    """An MLP classifier with torchmetrics accuracy, logged per epoch."""

    def __init__(self, lr: float = 0.05, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
        )
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_losses.append(F.cross_entropy(logits, y))
        self.val_accuracy.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        # torchmetrics syncs the accuracy state across workers in compute();
        # sync_dist averages the loss.
        self.log("val_loss", torch.stack(self.val_losses).mean(), sync_dist=True)
        self.log("val_accuracy", self.val_accuracy.compute(), prog_bar=True)
        self.val_accuracy.reset()
        self.val_losses.clear()

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x), y)
        self.log("test_accuracy", self.test_accuracy, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class DigitsDataModule(pl.LightningDataModule):
    """The digits data, split into train and validation (validation doubles as test)."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = load_digits_tensors()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main() -> None:
    """Fit, then test the best checkpoint, from the command line."""
    from polytrain.lightning import RayStrategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddp", help="ddp, horovod, fairscale, deepspeed")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()

    pl.seed_everything(0)
    model = DigitsClassifier(lr=args.lr)
    data = DigitsDataModule()
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        strategy=RayStrategy(
            backend=args.backend, num_workers=args.num_workers, use_gpu=args.use_gpu
        ),
    )
    trainer.fit(model, datamodule=data)
    print("validation:", {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})
    print("best checkpoint:", trainer.checkpoint_callback.best_model_path)
    trainer.test(model, datamodule=data, ckpt_path="best")


if __name__ == "__main__":
    main()
