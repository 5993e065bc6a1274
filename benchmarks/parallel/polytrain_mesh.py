"""The same mesh through polytrain: ``TorchTrainer(backend="fsdp", parallelism=...)`` on 4 Ray workers.

The creators build what native_mesh.py builds (the model, the tokens, the optimizer); the
default step runs forward, backward, step, zero_grad. The warm-up steps run in one
``train()`` call, the timed steps in a second: its ``epoch_time_s`` (measured in
the workers, the slowest one) over the steps is the step time. Then the workers run
the native script's own timed loop (:func:`workload.timed_steps`) on the model
polytrain prepared: the same processes without polytrain's step, which separates
what the launcher's processes cost from what the step does. Last, every worker
reports its held bytes and peak memory.

With ``--turns DIR --windows W`` it takes turns with native_mesh.py instead
(turns.py): one ``train()`` call of ``W * spec.steps + 1`` steps whose data loader
holds the turn (:class:`TurnGate`, its ``collate_fn``): before the first batch of
each window it waits for the turn and starts the window's clock; before the first
batch of the next window it stops it and hands the turn over. A window thus times
whole steps of polytrain's loop, its bookkeeping after each step included.

Usage: python benchmarks/parallel/polytrain_mesh.py --spec JSON --out DIR [--turns DIR --windows W]
       [--backend-config JSON]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.parallel import turns, workload  # noqa: E402


def model_creator(config: dict):
    return workload.build_model(config["size"])


class TurnGate:
    """A ``collate_fn`` that opens and closes the turns windows (one batch per step).

    Each rank's loader calls it once per step, before the step; every
    ``window_steps``-th call ends the window before (a barrier, then the clock) and,
    after waiting for the turn, begins the next one (a barrier, then the clock).
    """

    def __init__(self, directory: str, windows: int, window_steps: int) -> None:
        self.side = turns.Turns(directory, "polytrain", windows)
        self.window_steps = window_steps
        self.batches = 0
        self.started = 0.0
        self.faults = 0

    def __call__(self, samples: list) -> dict:
        import torch
        import torch.distributed as dist

        index, self.batches = self.batches, self.batches + 1
        if index % self.window_steps == 0:
            window = index // self.window_steps
            rank = dist.get_rank()
            if window > 0:
                dist.barrier()
                seconds = time.perf_counter() - self.started
                faults = turns.gather_faults(self.faults)  # after the clock stopped
                if rank == 0:
                    self.side.hand_over(window - 1, seconds, self.window_steps, faults)
            elif rank == 0:
                self.side.mark_ready()
            if window < self.side.windows:
                turns.release_heap()  # as the native ranks do before their turns
                self.side.wait_for(self.side.turn_of(window))
                dist.barrier()
                self.faults = turns.page_faults()
                self.started = time.perf_counter()
            else:  # the one step after the last window: run once both jobs are done
                self.side.wait_for(self.side.end)
        return torch.utils.data.default_collate(samples)


def data_creator(config: dict):
    import torch

    spec = workload.Spec.from_json(config["spec"])
    gate = None
    if config.get("turns"):
        steps = config["windows"] * spec.steps + 1
        gate = TurnGate(config["turns"], config["windows"], spec.steps)
    else:
        steps = spec.warmup + spec.steps
    ids = workload.token_ids(spec.size, steps * spec.data_parallel)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(data, batch_size=config["batch_size"], collate_fn=gate)


def optimizer_creator(model, config: dict):
    spec = workload.Spec.from_json(config["spec"])
    return workload.make_optimizer(model.parameters(), spec.optimizer)


def worker_loop(operator, spec_json: str) -> dict:
    """The native script's timed steps, run in this polytrain worker on the model it prepared."""
    from polytrain.backends.core.parallelism import data_parallel_rank

    spec = workload.Spec.from_json(spec_json)
    strategy = operator.strategy
    if hasattr(strategy, "coordinates"):  # a mesh; plain FSDP 4 runs the 1-D strategy
        dp_rank = data_parallel_rank(strategy.parallelism, strategy.coordinates)
    else:
        dp_rank = operator.world_rank
    first = spec.warmup + spec.steps  # after the trainer's own steps
    return workload.timed_steps(operator.model, operator.optimizer, spec, dp_rank, first)


def held(operator) -> dict:
    return {
        "rank": operator.world_rank,
        "held": workload.held_bytes(operator.model, operator.optimizer),
        "peak_rss_mb": workload.peak_rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--turns", help="take turns with the native script through this directory")
    parser.add_argument("--windows", type=int, default=0)
    parser.add_argument("--backend-config", default="{}", help="the fsdp backend_config, as JSON")
    args = parser.parse_args()
    spec = workload.Spec.from_json(args.spec)
    os.environ.setdefault("POLYTRAIN_WARM_POOL", "0")
    import ray

    from polytrain import TorchTrainer

    # A private local instance with a logical CPU per worker (the machine may have fewer
    # cores than workers, as torchrun's 4 processes share them too).
    ray.init(
        num_cpus=workload.NUM_WORKERS,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        config={
            "size": spec.size,
            "spec": spec.to_json(),
            "batch_size": spec.data_parallel,
            "turns": args.turns,
            "windows": args.windows,
        },
        num_workers=workload.NUM_WORKERS,
        backend="fsdp",
        backend_config=json.loads(args.backend_config),
        parallelism=spec.mesh,
        failure_config={"max_retries": 0},
    )
    try:
        if args.turns:
            stats = trainer.train(num_steps=args.windows * spec.steps + 1)
            result = {"epoch_time_s": stats["epoch_time_s"]}
        else:
            trainer.train(num_steps=spec.warmup)
            timed = trainer.train(num_steps=spec.steps)
            loops = trainer.apply_all_operators(
                functools.partial(worker_loop, spec_json=spec.to_json())
            )
            result = {
                "step_s": timed["epoch_time_s"] / spec.steps,
                "worker_loop_step_s": max(loop["step_s"] for loop in loops),
            }
        result["workers"] = trainer.apply_all_operators(functools.partial(held))
    finally:
        trainer.shutdown()
        ray.shutdown()
    (Path(args.out) / "polytrain.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
