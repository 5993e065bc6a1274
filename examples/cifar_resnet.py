"""RaySGD's CIFAR10 + ResNet18 example on polytrain: a ResNet-18 on any torch backend.

Run it:  python examples/cifar_resnet.py --backend ddp --num-workers 2 --epochs 1

RaySGD's ``cifar_pytorch_example.py`` with its creators kept as they were: SGD with
momentum, ``MultiStepLR`` stepped per epoch, ``nn.CrossEntropyLoss``, a global batch of
128 per worker. The model is torchvision's ``resnet18(num_classes=10)`` when torchvision
imports beside the installed torch (``pip install "polytrain[vision]"``); otherwise
:class:`ResNet18` below, the same network in plain torch: the same layers, parameter
names and shapes (11,181,642 parameters with 10 classes) and the same initialisation
scheme, so checkpoints of either load into the other. torchvision's ``resnet18`` takes
keyword arguments only, so ``model_creator`` is a function of ``config`` that calls it
(``model_creator=resnet18`` is refused with that one-line fix).

Data: the real CIFAR10 when torchvision's ``cifar-10-batches-py`` folder lies in
``--data-dir`` (nothing is ever downloaded); otherwise a small generated set of the
same shape (3x32x32 images, 10 classes, fixed seed) that a network can learn.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

SEED = 0
NUM_CLASSES = 10
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def torchvision_problem() -> str | None:
    """Why torchvision cannot be used here, or None when it imports and builds models."""
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        return 'torchvision is not installed: pip install "polytrain[vision]"'
    except (ImportError, RuntimeError) as exc:
        # A torchvision built for another torch fails at import with
        # "operator torchvision::nms does not exist".
        return (
            f"torchvision does not import beside torch {torch.__version__} ({exc}): install "
            f"the torchvision release built for this torch (the same CPU or CUDA build)"
        )
    return None


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (torchvision's ``BasicBlock``)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 in plain torch, laid out as torchvision's ``resnet18`` (names, shapes, init).

    A 7x7 stem with max pooling, four stages of two :class:`BasicBlock` each (64, 128,
    256 and 512 channels, the last three halving the resolution), global average
    pooling and a linear head.
    """

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = (64, 128, 256, 512)
        for index, planes in enumerate(widths):
            inplanes = widths[max(index - 1, 0)]
            stride = 1 if index == 0 else 2
            stage = nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes))
            setattr(self, f"layer{index + 1}", stage)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def model_creator(config: dict) -> torch.nn.Module:
    """A ResNet-18 with a 10-class head, the same initial weights on every worker.

    torchvision's ``resnet18`` when torchvision imports, else :class:`ResNet18`;
    ``config["torchvision"] = False`` picks the plain-torch one even then.
    """
    torch.manual_seed(config.get("seed", SEED))
    if config.get("torchvision", True) and torchvision_problem() is None:
        from torchvision.models import resnet18

        return resnet18(num_classes=NUM_CLASSES)
    return ResNet18(num_classes=NUM_CLASSES)


def generated_cifar(num_samples: int, seed: int = SEED) -> TensorDataset:
    """CIFAR-shaped data with a fixed seed: 3x32x32 images, labels 0-9.

    Each class is a smooth colour pattern of its own (a 4x4 grid of random colours,
    upsampled), each image that pattern plus noise, so accuracy rises above chance
    (10 %) within an epoch. Images are standardised like the real set after its
    ``Normalize`` transform.
    """
    templates_rng = torch.Generator().manual_seed(SEED)
    templates = torch.nn.functional.interpolate(
        torch.randn(NUM_CLASSES, 3, 4, 4, generator=templates_rng),
        size=(32, 32),
        mode="bilinear",
        align_corners=False,
    )
    rng = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=rng)
    images = templates[labels] + torch.randn(num_samples, 3, 32, 32, generator=rng)
    return TensorDataset(images, labels)


def cifar_datasets(config: dict) -> tuple[Dataset, Dataset]:
    """The real CIFAR10 train/test sets when they are on disk, else generated ones."""
    data_dir = os.path.expanduser(config.get("data_dir", "~/data"))
    on_disk = os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py"))
    if on_disk and torchvision_problem() is None:
        from torchvision import datasets, transforms

        normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
        train_transform = transforms.Compose(
            [
                transforms.RandomCrop(32, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        )
        val_transform = transforms.Compose([transforms.ToTensor(), normalize])
        train = datasets.CIFAR10(data_dir, train=True, download=False, transform=train_transform)
        val = datasets.CIFAR10(data_dir, train=False, download=False, transform=val_transform)
    else:
        train = generated_cifar(config.get("num_train", 2048), seed=SEED)
        val = generated_cifar(config.get("num_val", 512), seed=SEED + 1)
    if config.get("test_mode"):
        # RaySGD's smoke test: the first 64 samples of each split.
        train, val = Subset(train, range(64)), Subset(val, range(64))
    return train, val


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders; ``config["batch_size"]`` is this worker's share."""
    train, val = cifar_datasets(config)
    generator = torch.Generator().manual_seed(config.get("seed", SEED))
    return (
        DataLoader(train, batch_size=config["batch_size"], shuffle=True, generator=generator),
        DataLoader(val, batch_size=config["batch_size"]),
    )


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """RaySGD's optimizer: SGD with momentum."""
    return torch.optim.SGD(
        model.parameters(), lr=config.get("lr", 0.1), momentum=config.get("momentum", 0.9)
    )


def scheduler_creator(optimizer: torch.optim.Optimizer, config: dict):
    """RaySGD's schedule: divide the learning rate by 10 at epochs 150, 250 and 350."""
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[150, 250, 350], gamma=0.1)


loss_creator = torch.nn.CrossEntropyLoss


def main() -> None:
    """Train and validate from the command line."""
    from polytrain import TorchTrainer, available_backends

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddp", help=f"one of {available_backends('torch')}")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, help="the global batch (default 128 a worker)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--data-dir", default="~/data", help="where cifar-10-batches-py may lie")
    parser.add_argument("--smoke-test", action="store_true", help="64 samples a split")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=loss_creator,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq="epoch",
        config={
            "lr": args.lr,
            "batch_size": args.batch_size or 128 * args.num_workers,
            "data_dir": args.data_dir,
            "test_mode": args.smoke_test,
        },
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        backend=args.backend,
        use_tqdm=True,
    )
    try:
        for _ in range(args.epochs):
            stats = trainer.train()
            val = trainer.validate()
            print(
                f"epoch {stats['epoch']}: loss {stats['loss']:.4f}  "
                f"val_loss {val['val_loss']:.4f}  val_accuracy {val['val_accuracy']:.3f}  "
                f"{stats['samples_per_s']:.0f} samples/s"
            )
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
