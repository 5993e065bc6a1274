"""Plain PyTorch DDP, launched with ``torchrun --nproc_per_node=2``: the baseline of the ddp benchmark.

Usage: torchrun --nproc_per_node=2 benchmarks/native/ddp_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()  # before the heavy imports: what the interpreter start costs is visible

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import recorder  # noqa: E402


def main() -> None:
    """Train the workload with DDP on the torchrun-given rank and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    task = load_task(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.mark("process_group")
    model = DistributedDataParallel(task.build_model())
    optimizer = task.make_optimizer(model)
    loader = task.make_loader(rank, world)
    rec.mark("wrapped")

    def step(batch: object) -> None:
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    task.run(loader, step)
    recorder.write_summary(args.result_dir, rank, {"local_rank": os.environ.get("LOCAL_RANK")})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
