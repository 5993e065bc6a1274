"""The digits job as a Hydra app: config groups for the backend and the cluster.

Run from the repository root (the creators are imported as ``examples.digits``)::

    python examples/hydra/train.py                                  # ddp on this machine
    python examples/hydra/train.py backend=horovod trainer.num_workers=4 trainer.use_gpu=true
    python examples/hydra/train.py backend=deepspeed backend.backend_config.stage=3
    python examples/hydra/train.py cluster=ray_cluster               # a running Ray cluster
    python examples/hydra/train.py -m backend=ddp,horovod,deepspeed  # one job per backend

``cfg.trainer`` holds run-config keys (the README's "Run configs"), so
``polytrain.load_config(cfg.trainer)`` validates it like a YAML run config. Each job
prints its final metrics and writes ``metrics.jsonl`` (a line per epoch) and
``metrics.json`` (the final ones, with the backend) into its Hydra output directory:
``outputs/<date>/<time>/``, or ``multirun/<date>/<time>/<job number>/`` with ``-m``.
Needs the hydra extra: ``pip install "polytrain[hydra]"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import polytrain


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Train ``cfg.trainer`` for its epochs; returns the final metrics."""
    run = polytrain.load_config(cfg.trainer)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    trainer = run.build_trainer()
    try:
        with (out_dir / "metrics.jsonl").open("w") as lines:
            for _ in range(run.epochs):
                # end_epoch: with num_steps, an epoch of that many steps.
                stats = trainer.train(num_steps=run.num_steps, end_epoch=True)
                val = trainer.validate() if run.validate_each_epoch else {}
                lines.write(json.dumps({**stats, **val}, default=str) + "\n")
                print(f"epoch {stats['epoch']}: loss {stats['loss']:.4f}", flush=True)
        final = {
            "backend": trainer.backend_name,
            "num_workers": trainer.num_workers,
            **stats,
            **val,
        }
    finally:
        trainer.shutdown()
    (out_dir / "metrics.json").write_text(json.dumps(final, indent=2, default=str))
    print(f"final metrics ({trainer.backend_name}): {json.dumps(final, default=str)}", flush=True)
    return final


if __name__ == "__main__":
    main()
