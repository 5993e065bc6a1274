"""Plain fairscale OSS + ShardedDataParallel under ``torchrun --nproc_per_node=2``.

Usage: torchrun --nproc_per_node=2 benchmarks/native/fairscale_native.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: E402
from fairscale.optim import OSS  # noqa: E402

from benchmarks import workload  # noqa: E402


def main() -> None:
    """Train the workload with optimizer-state and gradient sharding and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    rec = workload.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    spec = workload.WorkloadSpec.from_json(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.mark("process_group")
    module = workload.build_model(spec)
    optim_cls = torch.optim.SGD if spec.optimizer == "sgd" else torch.optim.Adam
    defaults = workload.make_optimizer(torch.nn.Linear(1, 1), spec).defaults
    optimizer = OSS(module.parameters(), optim=optim_cls, **defaults)
    model = ShardedDataParallel(module, optimizer)
    criterion = torch.nn.CrossEntropyLoss()
    loader = workload.make_loader(spec, rank, world)
    rec.mark("wrapped")

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(model(features), target)
        model.zero_grad()  # OSS.zero_grad() would set grads to None under ShardedDDP
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    workload.run_steps(loader, step, spec.steps)
    workload.write_summary(args.result_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
