"""A checkpoint loaded under a changed config (a PBT exploit): the optimizers follow the config.

Local mode (``num_workers=0``): no Ray. Loading restores the checkpoint's optimizer
state, learning rate included; :func:`follow_config_changes` then applies what the new
config changes, scaling the scheduled lr so that the schedule keeps its progress.
"""

from __future__ import annotations

import pytest
import torch

from examples import digits
from polytrain import TorchTrainer
from polytrain.trainer_api.trainable import follow_config_changes


def _trainer(lr: float) -> TorchTrainer:
    return TorchTrainer(
        model_creator=digits.model_creator,
        data_creator=digits.data_creator,
        optimizer_creator=digits.optimizer_creator,
        scheduler_creator=digits.scheduler_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        scheduler_step_freq="epoch",
        config={"lr": lr, "batch_size": 32, "lr_step": 1},  # StepLR halves lr every epoch
        num_workers=0,
    )


def _lrs(trainer: TorchTrainer) -> list[tuple[float, float]]:
    return trainer.apply_all_operators(
        lambda op: (op.optimizer.param_groups[0]["lr"], op.scheduler.base_lrs[0])
    )


def test_changed_lr_replaces_the_checkpoints_and_the_schedule_keeps_its_progress(tmp_path):
    first = _trainer(0.1)
    first.train(num_steps=2, end_epoch=True)  # one epoch: StepLR took lr to 0.05
    first.save(tmp_path / "ckpt.pt")
    saved = dict(first.config)
    first.shutdown()

    second = _trainer(0.2)
    second.load(tmp_path / "ckpt.pt")
    assert _lrs(second) == [(0.05, 0.1)]  # the checkpoint's: the new lr would be lost
    assert follow_config_changes(second, saved) == {"lr": (0.1, 0.2)}
    ((lr, base),) = _lrs(second)
    assert lr == pytest.approx(0.1) and base == 0.2  # 0.2 halved once, as the schedule had
    second.train(num_steps=2, end_epoch=True)
    assert _lrs(second)[0][0] == pytest.approx(0.05)
    assert follow_config_changes(second, dict(second.config)) == {}  # same config: untouched
    second.shutdown()
