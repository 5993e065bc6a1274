"""A script for the deepspeed launcher (--local_rank, deepspeed.initialize, ZeRO-1), run unmodified.

deepspeed --num_gpus 2 deepspeed_launcher_script.py [--steps N]
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
engine, _, _, _ = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), config=ds_config
)
torch.manual_seed(dist.get_rank())
for _step in range(args.steps):
    x, y = torch.randn(4, 16), torch.randn(4, 1)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
weight = model[0].weight.detach().sum().reshape(1)
weights = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(weights, weight)
print(
    f"ds rank {dist.get_rank()} world {dist.get_world_size()} local_rank_arg {args.local_rank} "
    f"LOCAL_RANK {os.environ['LOCAL_RANK']} LOCAL_SIZE {os.environ['LOCAL_SIZE']} "
    f"CROSS_RANK {os.environ['CROSS_RANK']} CROSS_SIZE {os.environ['CROSS_SIZE']} "
    f"rank_sum {total.item():.0f} replicas_equal {all(torch.equal(w, weights[0]) for w in weights)}"
)
dist.barrier()
dist.destroy_process_group()
