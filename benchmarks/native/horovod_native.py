"""Plain Horovod, launched with ``horovodrun --gloo -np 2``: the baseline of the horovod benchmark.

Usage: horovodrun --gloo -np 2 python benchmarks/native/horovod_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import recorder  # noqa: E402


def main() -> None:
    """Train the workload with hvd.DistributedOptimizer and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    task = load_task(args.spec)
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    rec.mark("process_group")
    model = task.build_model()
    optimizer = hvd.DistributedOptimizer(
        task.make_optimizer(model), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
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
    recorder.write_summary(args.result_dir, rank)
    hvd.shutdown()


if __name__ == "__main__":
    main()
