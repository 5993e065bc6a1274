"""A driver process for the driver-crash resume test: train to EPOCHS epochs, resuming if it can.

Usage: python resume_driver.py RAY_ADDRESS CHECKPOINT_DIR EPOCHS OUT_FILE [BACKEND]

With ``CheckpointConfig(resume=True)`` a second run of the same command (after
the first was killed) continues from the newest committed checkpoint. Prints
``epoch N`` after every epoch and writes the consolidated final state to OUT_FILE.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
import torch  # noqa: E402

from polytrain import TorchTrainer, TrainingOperator  # noqa: E402
from tests.integration.test_checkpoint_dir import (  # noqa: E402
    data_creator,
    model_creator,
    optimizer_creator,
    scheduler_creator,
)


class Slow(TrainingOperator):
    """Each batch takes a little longer, so that the driver can be killed mid-epoch."""

    def train_batch(self, batch, batch_info):
        time.sleep(0.05)
        return super().train_batch(batch, batch_info)


def main() -> None:
    address, folder, epochs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    backend = sys.argv[5] if len(sys.argv) > 5 else "ddp"
    ray.init(address=address, configure_logging=False)
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        scheduler_creator=scheduler_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=Slow,
        config={"lr": 0.01, "batch_size": 32},
        num_workers=2,
        backend=backend,
        checkpoint_config={"checkpoint_dir": folder, "resume": True},
    )
    print(f"start epoch {trainer.epoch}", flush=True)
    try:
        while trainer.epoch < epochs:
            trainer.train()
            print(f"epoch {trainer.epoch}", flush=True)
        trainer.save(out)
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
