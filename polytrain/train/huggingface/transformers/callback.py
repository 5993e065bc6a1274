"""``RayTrainReportCallback``: the HF Trainer's metrics and checkpoints, reported to polytrain."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import transformers
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from polytrain.train import session as train_session
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.huggingface.transformers.prepare import check_trainer_setup


class RayTrainReportCallback(TrainerCallback):
    """Report the Trainer's metrics and every checkpoint it saves (Ray Train's callback).

    At each save (``on_save``, on every rank) the metrics the Trainer has logged so
    far are merged, newest last (``loss``, ``learning_rate``, ``eval_loss``,
    ``epoch``, ``step``, ...), and reported with the saved HF checkpoint, which sits
    in the polytrain checkpoint as ``checkpoint/``::

        checkpoint_00000N/     polytrain checkpoint (get_checkpoint(), Result.checkpoint)
        └─ checkpoint/         the Trainer's checkpoint-<step> folder

    A restarted loop resumes with ``trainer.train(resume_from_checkpoint=...)`` on
    that folder. Save, evaluate and log at matching intervals (``save_steps`` a
    multiple of ``eval_steps``, or both ``"epoch"``) so the reported metrics are
    those of the checkpoint.

    The ranks wait for each other before the copy (the Trainer writes a checkpoint
    from several ranks); the first rank of each node copies the folder, so a node
    without shared storage adds the files its ranks wrote.
    """

    CHECKPOINT_NAME = "checkpoint"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a backend the Trainer cannot train on, before the first step."""
        check_trainer_setup("RayTrainReportCallback at the start of training")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the merged logged metrics and the checkpoint just saved."""
        metrics: dict[str, Any] = {}
        for entry in state.log_history:
            metrics.update(entry)
        source = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(source):
            source = transformers.trainer_utils.get_last_checkpoint(args.output_dir)
        _wait_for_ranks()
        session = train_session.current("huggingface.transformers.RayTrainReportCallback")
        copies = session.context.get_local_rank() == 0
        with tempfile.TemporaryDirectory(prefix="hf_checkpoint_") as tmp:
            checkpoint = None
            if source is not None and copies:
                shutil.copytree(source, os.path.join(tmp, self.CHECKPOINT_NAME))
                checkpoint = Checkpoint.from_directory(tmp)
            train_session.report(metrics, checkpoint=checkpoint)


def _wait_for_ranks() -> None:
    """Every rank has written its part of the checkpoint (rank 0 the weights, each its RNG state)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
