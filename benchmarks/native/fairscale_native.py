"""Plain fairscale OSS + ShardedDataParallel under ``torchrun --nproc_per_node=2``.

Usage: torchrun --nproc_per_node=2 benchmarks/native/fairscale_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import inspect  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: E402
from fairscale.optim import OSS  # noqa: E402

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import recorder  # noqa: E402


def main() -> None:
    """Train the workload with optimizer-state and gradient sharding and record the timings."""
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
    module = task.build_model()
    # The workload's optimizer class and settings, rebuilt as OSS (as polytrain's backend does).
    # (AdamW's defaults hold decoupled_weight_decay, which its constructor does not take.)
    template = task.make_optimizer(torch.nn.Linear(1, 1))
    accepted = inspect.signature(type(template)).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    optimizer = OSS(module.parameters(), optim=type(template), **defaults)
    model = ShardedDataParallel(module, optimizer)
    loader = task.make_loader(rank, world)
    rec.mark("wrapped")

    def step(batch: object) -> None:
        loss = task.loss(model, batch)
        model.zero_grad()  # OSS.zero_grad() would set grads to None under ShardedDDP
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    task.run(loader, step)
    recorder.write_summary(args.result_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
