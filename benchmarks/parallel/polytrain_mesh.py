"""The same mesh through polytrain: ``TorchTrainer(backend="fsdp", parallelism=...)`` on 4 Ray workers.

The creators build what native_mesh.py builds (the model, the tokens, AdamW); the
default step runs forward, backward, step, zero_grad. The warm-up steps run in one
``train()`` call, the timed steps in a second: its ``epoch_time_s`` (measured in
the workers, the slowest one) over the steps is the step time. Then the workers run
the native script's own timed loop (:func:`workload.timed_steps`) on the model
polytrain prepared: the same processes without polytrain's step, which separates
what the launcher's processes cost from what the step does. Last, every worker
reports its held bytes and peak memory.

Usage: python benchmarks/parallel/polytrain_mesh.py --spec JSON --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.parallel import workload  # noqa: E402


def model_creator(config: dict):
    return workload.build_model(config["size"])


def data_creator(config: dict):
    import torch

    spec = workload.Spec.from_json(config["spec"])
    ids = workload.token_ids(spec.size, (spec.warmup + spec.steps) * spec.data_parallel)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(data, batch_size=config["batch_size"])


def optimizer_creator(model, config: dict):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=workload.LR)


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
        config={"size": spec.size, "spec": spec.to_json(), "batch_size": spec.data_parallel},
        num_workers=workload.NUM_WORKERS,
        backend="fsdp",
        parallelism=spec.mesh,
        failure_config={"max_retries": 0},
    )
    try:
        trainer.train(num_steps=spec.warmup)
        timed = trainer.train(num_steps=spec.steps)
        loops = trainer.apply_all_operators(
            functools.partial(worker_loop, spec_json=spec.to_json())
        )
        workers = trainer.apply_all_operators(functools.partial(held))
    finally:
        trainer.shutdown()
        ray.shutdown()
    result = {
        "step_s": timed["epoch_time_s"] / spec.steps,
        "worker_loop_step_s": max(loop["step_s"] for loop in loops),
        "workers": workers,
    }
    (Path(args.out) / "polytrain.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
