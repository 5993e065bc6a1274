"""Ray Train's own TorchTrainer on the workload (``ScalingConfig(num_workers=2)``), for comparison.

The training loop is the native DDP loop, with Ray Train's ``prepare_model``
doing the DDP wrap; every worker times its steps like the native script.

Usage: python benchmarks/drivers/raytrain_torch.py --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.workloads import mlp, recorder  # noqa: E402


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: the native DDP loop."""
    import ray.train
    import ray.train.torch

    rec = recorder.RECORDER
    rec.mark("loop_start")
    spec = mlp.WorkloadSpec.from_json(config["spec"])
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = ray.train.torch.prepare_model(mlp.build_model(spec))
    optimizer = mlp.make_optimizer(model, spec)
    criterion = torch.nn.CrossEntropyLoss()
    loader = mlp.make_loader(spec, rank, world)
    rec.mark("wrapped")

    def step(features: torch.Tensor, target: torch.Tensor) -> None:
        loss = criterion(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    model.train()
    mlp.run_steps(loader, step, spec.steps)
    recorder.write_summary(config["result_dir"], rank)


def main() -> None:
    """Run Ray Train's TorchTrainer once; the workers write their records."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks = {"script_start": _START, "imported": time.time()}
    ray.init(include_dashboard=False, configure_logging=False)
    marks["ray_init_done"] = time.time()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"spec": args.spec, "result_dir": args.result_dir},
        scaling_config=ScalingConfig(num_workers=mlp.NUM_WORKERS),
        run_config=RunConfig(storage_path=str(Path(args.result_dir) / "ray_results")),
    )
    trainer.fit()
    marks["train_done"] = time.time()
    Path(args.result_dir, "driver.json").write_text(json.dumps({"marks": marks}))
    ray.shutdown()


if __name__ == "__main__":
    main()
