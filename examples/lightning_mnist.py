"""Two classic LightningModules (Lightning 2.x) trained on Ray actors with any backend.

``LightningMNISTClassifier`` is the classifier of the Ray Lightning article (three
Linear layers, ``log_softmax``, ``nll_loss``), ported to Lightning 2.x with the three
edits every 1.x module of its kind needs: ``on_validation_epoch_end`` instead of
``validation_epoch_end(outputs)``, ``torchmetrics.Accuracy(task="multiclass", ...)``,
and the data sets built in ``setup()`` (``prepare_data`` runs on local rank 0 only).
Its data is MNIST-shaped and generated with a fixed seed (nothing to download).
``DigitsClassifier`` is an MLP on scikit-learn's 8x8 digits (shipped with the package).

The modules are plain Lightning: nothing in them knows about polytrain or Ray. Only
the ``strategy=`` argument of the Trainer changes between backends.

Run it:  python examples/lightning_mnist.py --backend horovod --num-workers 2 --epochs 3
         python examples/lightning_mnist.py --model digits --backend ddp
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
import torchmetrics
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.digits import load_digits_tensors

SEED = 0


def generated_mnist(num_samples: int, seed: int = SEED) -> TensorDataset:
    """MNIST-shaped data with a fixed seed: 1x28x28 images, labels 0-9.

    Each class is a pattern of its own (a 7x7 grid, scaled up), each image that
    pattern plus noise, standardised like MNIST after ``Normalize((0.1307,), (0.3081,))``.
    """
    patterns = torch.rand(10, 1, 7, 7, generator=torch.Generator().manual_seed(SEED))
    patterns = patterns.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)
    rng = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (num_samples,), generator=rng)
    noise = 0.3 * torch.randn(num_samples, 1, 28, 28, generator=rng)
    images = (patterns[labels] + noise).clamp(0, 1)
    return TensorDataset((images - 0.1307) / 0.3081, labels)


class LightningMNISTClassifier(pl.LightningModule):
    """The Ray Lightning article's MNIST classifier in its Lightning 2.x form.

    Args:
        config: ``layer_1_size``, ``layer_2_size``, ``lr`` and ``batch_size`` (the
            article's keys, tuned by Ray Tune there); optional ``num_train`` and
            ``num_val``, the sizes of the generated data sets.
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = config
        self.lr = config["lr"]
        self.batch_size = config["batch_size"]
        # mnist images are (1, 28, 28) (channels, width, height)
        self.layer_1 = torch.nn.Linear(28 * 28, config["layer_1_size"])
        self.layer_2 = torch.nn.Linear(config["layer_1_size"], config["layer_2_size"])
        self.layer_3 = torch.nn.Linear(config["layer_2_size"], 10)
        # Edit 2: torchmetrics' Accuracy needs its task; it syncs across workers in compute().
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size = x.size(0)
        x = x.view(batch_size, -1)
        x = torch.relu(self.layer_1(x))
        x = torch.relu(self.layer_2(x))
        return torch.log_softmax(self.layer_3(x), dim=1)

    def training_step(self, train_batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = train_batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        self.train_accuracy(logits, y)
        self.log("ptl/train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("ptl/train_accuracy", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, val_batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = val_batch
        logits = self(x)
        self.val_losses.append(F.nll_loss(logits, y))
        self.val_accuracy.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        # Edit 1: Lightning 2.x passes no outputs; the steps collect what the epoch needs.
        self.log("ptl/val_loss", torch.stack(self.val_losses).mean(), sync_dist=True)
        self.log("ptl/val_accuracy", self.val_accuracy.compute())
        self.val_accuracy.reset()
        self.val_losses.clear()

    def setup(self, stage: str) -> None:
        # Edit 3: built on every worker; prepare_data runs on local rank 0 only, so data
        # sets assigned there would be missing on the other ranks.
        self.mnist_train = generated_mnist(self.config.get("num_train", 2048), seed=SEED)
        self.mnist_val = generated_mnist(self.config.get("num_val", 512), seed=SEED + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.mnist_train, batch_size=int(self.batch_size), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.mnist_val, batch_size=int(self.batch_size))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


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
    """Fit from the command line; the digits model is tested on its best checkpoint too."""
    from polytrain.lightning import RayStrategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mnist", "digits"], default="mnist")
    parser.add_argument("--backend", default="ddp", help="ddp, horovod, fairscale, deepspeed")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, help="default 1e-3 (mnist, Adam), 0.05 (digits, SGD)")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()

    pl.seed_everything(0)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        strategy=RayStrategy(
            backend=args.backend, num_workers=args.num_workers, use_gpu=args.use_gpu
        ),
    )
    if args.model == "mnist":
        config = {"layer_1_size": 128, "layer_2_size": 256, "lr": args.lr or 1e-3, "batch_size": 64}
        trainer.fit(LightningMNISTClassifier(config))
    else:
        model, data = DigitsClassifier(lr=args.lr or 0.05), DigitsDataModule()
        trainer.fit(model, datamodule=data)
    print("validation:", {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})
    print("best checkpoint:", trainer.checkpoint_callback.best_model_path)
    if args.model == "digits":
        trainer.test(model, datamodule=data, ckpt_path="best")


if __name__ == "__main__":
    main()
