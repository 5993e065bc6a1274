"""A function-API loop in local mode, run by the torchrun tests (and as one process for reference).

    torchrun --nproc-per-node 2 torchrun_local_loop.py OUT_DIR [--backend ddp] [--steps 6]
    python torchrun_local_loop.py OUT_DIR            # the same loop as one process

Writes ``OUT_DIR/result-rank<R>.json`` on every rank: the global loss of each step
(the mean over ranks, as one process computes it on the whole batch), Ray's
presence, the world the loop saw, what ``Result`` holds, and the final weights'
path. A second ``fit()`` with the same run name checks ``get_checkpoint()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from polytrain import train
from polytrain.train.torch import TorchTrainer, backward, prepare, prepare_data_loader, step

GLOBAL_BATCH = 16


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH * 8, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1
    return TensorDataset(x, y)


def loop(config: dict) -> None:
    context = train.get_context()
    world = context.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = prepare_data_loader(
        DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, shuffle=False)
    )
    model, optimizer = prepare(model, optimizer, data_loader=loader)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = json.load(open(os.path.join(d, "step.json")))["step"]
    for index, (x, y) in enumerate(loader):
        if index == config["steps"]:
            break
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        step()
        global_loss = loss.detach().clone()
        if dist.is_initialized():  # the loop may use torchrun's process group itself
            dist.all_reduce(global_loss)
            global_loss /= world
        metrics = {"loss": global_loss.item(), "world": world, "rank": context.get_world_rank()}
        if index == config["steps"] - 1:
            with tempfile.TemporaryDirectory() as d:
                if context.get_world_rank() == 0:
                    own = getattr(model, "module", model)  # DDP wraps it on 2 ranks
                    weights = {k: v.detach().cpu() for k, v in own.state_dict().items()}
                    torch.save(weights, os.path.join(d, "model.pt"))
                    json.dump(
                        {"step": start + config["steps"]}, open(os.path.join(d, "step.json"), "w")
                    )
                train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))
        else:
            train.report(metrics)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    run = {"storage_path": os.path.join(args.out, "runs"), "name": "local"}
    result = TorchTrainer(
        loop,
        train_loop_config={"steps": args.steps},
        backend=args.backend,
        scaling_config={"num_workers": 0},
        run_config=run,
    ).fit()
    again = TorchTrainer(
        loop,
        train_loop_config={"steps": 1},
        backend=args.backend,
        scaling_config={"num_workers": 0},
        run_config=run,
    ).fit()
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(args.out, f"result-rank{rank}.json"), "w") as handle:
        json.dump(
            {
                "ray_imported": "ray" in sys.modules,
                "losses": [m["loss"] for m in result.metrics_history],
                "worlds": sorted({m["world"] for m in result.metrics_history}),
                "reporting_rank": sorted({m["rank"] for m in result.metrics_history}),
                "checkpoint": result.checkpoint.path if result.checkpoint else None,
                "files": sorted(os.listdir(result.checkpoint.path)) if result.checkpoint else [],
                "resumed_checkpoints": len(again.metrics_history),
                "resumed_step": json.load(open(os.path.join(again.checkpoint.path, "step.json")))[
                    "step"
                ],
                "dist_left_initialized": dist.is_initialized(),
            },
            handle,
        )


if __name__ == "__main__":
    main()
