"""Exact resume with randomness in the step (issue 13, point 4): random states travel with the checkpoint.

A model with dropout draws from torch's global generator at every step. A worker lost
mid-epoch restarts from the newest mid-epoch checkpoint directory; with each rank's
generator states restored there, the recovered run ends with the uninterrupted run's
weights. Without them the dropout masks after the restart differ and so do the weights.
"""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer, TrainingOperator
from polytrain.checkpoint import rng_state


def _model(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 2)
    )


def _data(config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x.sum(1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=config["batch_size"], shuffle=True)


class DieOnceMidEpoch(TrainingOperator):
    """Rank 1's process exits at batch 5 of epoch 1, once; rank 0 logs the batches it trains."""

    def train_batch(self, batch, batch_info):
        at = (batch_info["epoch_idx"], batch_info["batch_idx"])
        marker = self.config["die_marker"]
        if self.config["die"] and self.world_rank == 1 and at == (1, 5):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
        if self.world_rank == 0:
            with open(self.config["batch_log"], "a") as log:
                log.write(f"{at[0]} {at[1]}\n")
        return super().train_batch(batch, batch_info)


def _run(tmp_path, die: bool) -> tuple[dict, list[str], list[int]]:
    log = tmp_path / f"batches-{die}.txt"
    trainer = TorchTrainer(
        model_creator=_model,
        data_creator=_data,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=DieOnceMidEpoch,
        config={
            "batch_size": 32,
            "die": die,
            "batch_log": str(log),
            "die_marker": str(tmp_path / "died"),
        },
        num_workers=2,
        backend="ddp",
        failure_config={"max_retries": 1},
        checkpoint_config={
            "checkpoint_dir": str(tmp_path / f"ckpt-{die}"),
            "every_n_steps": 2,
            "num_to_keep": 20,
        },
    )
    try:
        restarts = [trainer.train()["num_restarts"] for _ in range(3)]
        state = trainer.state_dict()
    finally:
        trainer.shutdown()
    return state, log.read_text().split("\n"), restarts


def test_a_model_with_dropout_resumes_mid_epoch_with_the_clean_runs_weights(
    ray_start_4_cpus, tmp_path
):
    clean_state, _, _ = _run(tmp_path, die=False)
    state, log, restarts = _run(tmp_path, die=True)
    assert restarts == [0, 1, 1]
    epoch_1 = [line for line in log if line.startswith("1 ")]
    assert epoch_1.count("1 4") == 2 and epoch_1.count("1 0") == 1  # resumed mid-epoch
    for key, value in clean_state["models"][0].items():
        assert torch.allclose(value, state["models"][0][key], rtol=0, atol=1e-6), key


def test_each_rank_writes_its_random_states_into_its_index(ray_start_4_cpus, tmp_path):
    folder = tmp_path / "ckpt"
    trainer = TorchTrainer(
        model_creator=_model,
        data_creator=_data,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 32},
        num_workers=2,
        checkpoint_config={"checkpoint_dir": str(folder)},
    )
    try:
        path = trainer.train()["checkpoint_path"]
    finally:
        trainer.shutdown()
    states = [json.loads((folder / path / f"rank_0000{r}.json").read_text())["rng"] for r in (0, 1)]
    for state in states:
        assert state["format"] == rng_state.FORMAT and state["torch"] and state["python"]
    rng_state.restore(states[0])  # readable as written, without unpickling
    before = torch.rand(3)
    rng_state.restore(states[0])
    assert torch.equal(before, torch.rand(3))
