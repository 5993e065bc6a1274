"""A torchrun script in the shape of PyTorch's DDP tutorial; run unmodified by polytrain launch.

torchrun --nproc-per-node 2 torchrun_ddp_script.py OUT_DIR [--fail-rank R] [--fail-on-restart N]
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(out_dir, fail_rank, fail_restart):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == fail_rank and restart <= fail_restart:
        print(f"rank {rank} fails on restart {restart}")
        sys.exit(3)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    torch.manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(ddp_model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
        optimizer.step()
    print(f"rank {rank} of {dist.get_world_size()} done")
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as handle:
        handle.write(
            f"{os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {restart} "
            f"{model.net1.weight.sum().item():.6f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-on-restart", type=int, default=-1)
    args = parser.parse_args()
    demo_basic(args.out_dir, args.fail_rank, args.fail_on_restart)
