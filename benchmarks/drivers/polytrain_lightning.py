"""polytrain's Lightning strategies on the benchmark's LightningModule: one driver process.

The module, the timing callback and the Trainer options are those of the native
run (:mod:`benchmarks.native.lightning_native`, Lightning's own ``strategy="ddp"``
under torchrun); only the strategy differs: ``RayStrategy(num_workers=2)``
(``--strategy ddp``, the default) or one of its variants, ``RayHorovodStrategy``
(``horovod``), ``RayShardedStrategy`` (``sharded``: fairscale OSS +
ShardedDataParallel) and ``RayDeepSpeedStrategy`` (``deepspeed``: ZeRO stage 2).
A variant whose library is not installed is skipped: the driver says why and
exits with status 3, writing no records.

Timing: ``ray.init`` (the same call the strategy makes when Ray is not running)
is timed on its own, then ``trainer.fit``. The workers' :class:`StepTimes`
callback records every step and writes ``rank*.json`` itself; the driver writes
``driver.json`` (its marks).

Usage: python benchmarks/drivers/polytrain_lightning.py [--strategy ddp|horovod|sharded|deepspeed]
       --spec JSON --result-dir DIR
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytorch_lightning as pl  # noqa: E402

import polytrain.lightning  # noqa: E402
from benchmarks.native.lightning_native import WorkloadModule, trainer_options  # noqa: E402
from benchmarks.workloads import mlp  # noqa: E402

#: ``--strategy`` value: (polytrain.lightning class name, the backend it fixes).
STRATEGIES = {
    "ddp": ("RayStrategy", "ddp"),
    "horovod": ("RayHorovodStrategy", "horovod"),
    "sharded": ("RayShardedStrategy", "fairscale"),
    "deepspeed": ("RayDeepSpeedStrategy", "deepspeed"),
}

#: Exit status of a run skipped because the variant's library is missing.
SKIPPED = 3


def missing_library(name: str) -> str | None:
    """Why ``--strategy name`` cannot run here (its backend's missing module), or None."""
    from polytrain.backends.registry import get_spec

    spec = get_spec(STRATEGIES[name][1])
    if spec.missing:
        return (
            f"--strategy {name} needs {spec.missing[0]!r}, which is not installed "
            f"(install: {spec.install_hint})"
        )
    return None


def make_strategy(name: str, num_workers: int = mlp.NUM_WORKERS) -> Any:
    """The polytrain strategy of ``--strategy name`` on ``num_workers`` Ray actors (1 CPU each)."""
    cls = getattr(polytrain.lightning, STRATEGIES[name][0])
    return cls(num_workers=num_workers, num_cpus_per_worker=1)


def main() -> int:
    """Fit the module once with the chosen strategy; the workers write their records."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    reason = missing_library(args.strategy)
    if reason is not None:
        print(f"skipped: {reason}", file=sys.stderr, flush=True)
        return SKIPPED
    spec = mlp.WorkloadSpec.from_json(args.spec)
    marks = {"script_start": _START, "imported": time.time()}
    from polytrain.launchers.cluster.connect import ensure_ray

    ensure_ray()
    marks["ray_init_done"] = time.time()
    strategy = make_strategy(args.strategy)
    trainer = pl.Trainer(strategy=strategy, **trainer_options(spec, args.result_dir))
    marks["trainer_ready"] = time.time()
    trainer.fit(WorkloadModule(spec))
    marks["fit_done"] = time.time()
    driver = {
        "marks": marks,
        "strategy": type(strategy).__name__,
        "backend": strategy.backend.name,
        "global_step": trainer.global_step,
    }
    (Path(args.result_dir) / "driver.json").write_text(json.dumps(driver))
    return 0


if __name__ == "__main__":
    sys.exit(main())
