"""A driver process for the preemption test: train EPOCHS epochs with mid-epoch checkpoints, resuming if it can.

Usage: python termination_driver.py RAY_ADDRESS CHECKPOINT_DIR EPOCHS OUT_FILE BATCH_LOG

Rank 0 appends ``epoch batch`` to BATCH_LOG for every batch it trains. SIGTERM
makes ``train()`` checkpoint at the next boundary and raise TerminatedError; this
script then prints ``preempted at E S PATH`` and exits with its ``exit_code``
(143). A second run of the same command resumes (``resume=True``) and writes the
consolidated final state to OUT_FILE.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
import torch  # noqa: E402

from polytrain import TorchTrainer, TrainingOperator  # noqa: E402
from polytrain.errors import TerminatedError  # noqa: E402
from tests.integration.test_exact_resume import _data, _model  # noqa: E402


class Logged(TrainingOperator):
    """Rank 0 logs each batch it trains; every batch takes a little time (room for the signal)."""

    def train_batch(self, batch, batch_info):
        time.sleep(0.1)
        if self.world_rank == 0:
            with open(self.config["batch_log"], "a") as log:
                log.write(f"{batch_info['epoch_idx']} {batch_info['batch_idx']}\n")
        return super().train_batch(batch, batch_info)


def main() -> int:
    address, folder, epochs, out, log = sys.argv[1:6]
    ray.init(address=address, configure_logging=False)
    trainer = TorchTrainer(
        model_creator=_model,
        data_creator=_data,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=Logged,
        config={"batch_size": 32, "batch_log": log},
        num_workers=2,
        checkpoint_config={
            "checkpoint_dir": folder,
            "every_n_steps": 3,
            "num_to_keep": 50,
            "resume": True,
        },
    )
    print(f"start {trainer.epoch} {trainer.position.epoch_step}", flush=True)
    try:
        while trainer.epoch < int(epochs):
            trainer.train()
        trainer.save(out)
    except TerminatedError as exc:
        print(f"TerminatedError: {exc}", file=sys.stderr, flush=True)
        print(
            f"preempted at {trainer.epoch} {trainer.position.epoch_step} {exc.checkpoint_path}",
            flush=True,
        )
        return exc.exit_code
    finally:
        trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
