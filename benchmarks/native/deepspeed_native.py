"""A plain DeepSpeed engine (ZeRO stage from ``--stage``), launched with ``torchrun --nproc_per_node=2``.

The user's torch optimizer is handed to ``deepspeed.initialize``, as polytrain's
deepspeed backend does, with the same engine settings (no gradient clipping,
fp32).

Usage: torchrun --nproc_per_node=2 benchmarks/native/deepspeed_native.py --spec JSON --result-dir DIR --stage 2
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.native.task import load_task  # noqa: E402
from benchmarks.workloads import recorder  # noqa: E402


def main() -> None:
    """Train the workload with a DeepSpeed ZeRO engine and record the timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    rec = recorder.RECORDER
    rec.marks["script_start"] = _START
    rec.mark("imported")
    task = load_task(args.spec)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.mark("process_group")
    module = task.build_model()
    config = {
        "train_batch_size": task.micro_batch(world) * world,
        "train_micro_batch_size_per_gpu": task.micro_batch(world),
        "zero_optimization": {"stage": args.stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=task.make_optimizer(module), config=config
    )
    loader = task.make_loader(rank, world)
    rec.mark("wrapped")

    def step(batch: object) -> None:
        loss = task.loss(engine, batch)
        engine.backward(loss)  # the engine clears gradients after its step
        engine.step()
        loss.item()

    engine.train()
    task.run(loader, step)
    recorder.write_summary(args.result_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
