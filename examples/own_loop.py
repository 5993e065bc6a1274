"""Ray Train's PyTorch quick-start on polytrain: your own loop, any backend.

Run it:  python examples/own_loop.py --num-workers 2 --backend ddp

Against Ray Train's quick-start the diff is the two import lines (``ray`` ->
``polytrain``); the model is a small MLP on scikit-learn's digits instead of a
ResNet on FashionMNIST, so it runs without a download. ``--backend horovod``
(or fairscale, fsdp, deepspeed) runs the same loop through that backend:
``prepare_model`` wraps the model the backend's way.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.nn import CrossEntropyLoss
from torch.optim import Adam
from torch.utils.data import DataLoader

import polytrain.train.torch  # noqa: F401 - was: import ray.train.torch
from examples.digits import load_digits_tensors
from polytrain import train  # was: from ray import train


def train_func():
    # Model, loss, optimizer
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # [1] Prepare model.
    model = train.torch.prepare_model(model)
    criterion = CrossEntropyLoss()
    optimizer = Adam(model.parameters(), lr=0.001)

    # Data
    train_data, _ = load_digits_tensors()
    train_loader = DataLoader(train_data, batch_size=128, shuffle=True)
    # [2] Prepare dataloader.
    train_loader = train.torch.prepare_data_loader(train_loader)

    # Training
    for epoch in range(5):
        if train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)

        for images, labels in train_loader:
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        # [3] Report metrics and checkpoint.
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            torch.save(
                getattr(model, "module", model).state_dict(),
                os.path.join(temp_checkpoint_dir, "model.pt"),
            )
            train.report(
                metrics,
                checkpoint=train.Checkpoint.from_directory(temp_checkpoint_dir),
            )
        if train.get_context().get_world_rank() == 0:
            print(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    # [4] Configure scaling and resource requirements.
    scaling_config = train.ScalingConfig(num_workers=args.num_workers, use_gpu=False)

    # [5] Launch distributed training job.
    trainer = train.torch.TorchTrainer(
        train_func,
        scaling_config=scaling_config,
        run_config=train.RunConfig(storage_path=args.storage_path),
        backend=args.backend,  # polytrain only: Ray Train has no backend choice
    )
    result = trainer.fit()

    # [6] Load the trained model.
    with result.checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
    print(
        f"final loss {result.metrics['loss']:.4f}; {len(model_state_dict)} tensors in the checkpoint"
    )


if __name__ == "__main__":
    main()
