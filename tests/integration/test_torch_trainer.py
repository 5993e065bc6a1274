"""TorchTrainer on real Ray actors with the ddp backend (gloo process groups)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from polytrain import TorchTrainer, TrainingOperator
from polytrain.errors import (
    CreatorError,
    InsufficientResourcesError,
    TrainerShutdownError,
    WorkerError,
)
from tests.helpers import (
    DIGITS,
    max_param_diff,
    parity_data_creator,
    parity_model_creator,
    parity_optimizer_creator,
    plain_reference,
)

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")


def test_digits_loss_falls_and_accuracy_beats_0_8(no_leftover_actors):
    trainer = TorchTrainer(**DIGITS, config={"lr": 0.1, "batch_size": 64}, num_workers=2)
    try:
        first = trainer.train()
        for _ in range(3):
            last = trainer.train()
        val = trainer.validate()
    finally:
        trainer.shutdown()
    assert last["loss"] < first["loss"] * 0.5
    assert val["val_accuracy"] > 0.8
    for key in ("epoch", "loss", "num_samples", "samples_per_s", "epoch_time_s"):
        assert key in last
    assert last["epoch"] == 3
    # 1437 training samples split between 2 workers by the distributed sampler (padded).
    assert last["num_samples"] == 1438
    assert val["num_samples"] == 360  # unpadded: every validation sample exactly once


def test_parity_with_plain_pytorch_loop():
    global_batch, steps = 32, 32  # 512 samples: 16 steps an epoch, two epochs
    trainer = TorchTrainer(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        optimizer_creator=parity_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"lr": 0.1, "batch_size": global_batch},
        num_workers=2,
    )
    try:
        stats = [trainer.train(), trainer.train(num_steps=100)]
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert sum(s["num_steps"] for s in stats) == steps
    reference = plain_reference(steps, global_batch)
    assert max_param_diff(model, reference) <= 1e-5


def test_checkpoint_round_trip_across_world_sizes(tmp_path):
    path = tmp_path / "ckpt.pt"
    config = {"lr": 0.1, "batch_size": 64}
    trainer = TorchTrainer(**DIGITS, config=config, num_workers=2)
    trainer.train()
    trainer.train()
    expected = trainer.validate()["val_loss"]
    assert trainer.save(path) == str(path.resolve())
    trainer.shutdown()

    for workers in (1, 0):
        other = TorchTrainer(**DIGITS, config=config, num_workers=workers)
        try:
            other.load(path)
            assert other.epoch == 2
            assert abs(other.validate()["val_loss"] - expected) <= 1e-6
            # training continues from the loaded optimizer state
            assert other.train()["epoch"] == 2
        finally:
            other.shutdown()


def test_local_mode_trains_in_process():
    trainer = TorchTrainer(**DIGITS, config={"lr": 0.1, "batch_size": 32}, num_workers=0)
    try:
        first = trainer.train()
        second = trainer.train()
        assert second["loss"] < first["loss"]
        assert trainer.validate()["val_accuracy"] > 0.8
        assert isinstance(trainer.get_model(), torch.nn.Sequential)
    finally:
        trainer.shutdown()


def test_scheduler_and_fp16_and_tqdm(capsys):
    def scheduler_creator(optimizer, config):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    trainer = TorchTrainer(
        **DIGITS,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq="epoch",
        config={"lr": 0.1, "batch_size": 64},
        num_workers=2,
        use_fp16=True,  # bf16 autocast on CPU
        use_tqdm=True,
    )
    try:
        trainer.train()
        trainer.train()
        state = trainer.state_dict()
    finally:
        trainer.shutdown()
    assert state["schedulers"][0]["last_epoch"] == 2
    assert state["optimizers"][0]["param_groups"][0]["lr"] == pytest.approx(0.025)
    assert "epoch 1" in capsys.readouterr().err


class TwoLossOperator(TrainingOperator):
    """A custom step: two models, two optimizers, an extra metric."""

    def train_batch(self, batch, batch_info):
        x, y = batch
        encoder, head = self.models
        with self.autocast():
            logits = head(encoder(x))
            loss = self.criterion(logits, y)
            penalty = 1e-4 * sum(p.pow(2).sum() for p in encoder.parameters())
        self.zero_grad()
        self.backward(loss + penalty)
        self.step()
        return {"loss": loss.item(), "penalty": penalty.item(), "num_samples": len(y)}

    def validate_batch(self, batch, batch_info):
        x, y = batch
        logits = self.models[1](self.models[0](x))
        return {
            "val_loss": self.criterion(logits, y).item(),
            "num_samples": len(y),
            "reported_by": f"rank {self.world_rank}",
        }


def test_custom_operator_with_two_models():
    def model_creator(config):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()), torch.nn.Linear(
            32, 10
        )

    def optimizer_creator(models, config):
        return tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in models)

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=DIGITS["data_creator"],
        optimizer_creator=optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=TwoLossOperator,
        config={"batch_size": 64},
        num_workers=2,
    )
    try:
        first = trainer.train()
        second = trainer.train()
        val = trainer.validate()
        encoder, head = trainer.get_model()
    finally:
        trainer.shutdown()
    assert second["loss"] < first["loss"]
    assert first["penalty"] > 0
    assert val["reported_by"] == "rank 0"  # non-numeric metrics keep rank 0's value
    assert isinstance(head, torch.nn.Linear)


def test_creators_defined_in_main_run_on_workers(ray_start_4_cpus, tmp_path):
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import ray, torch
        from torch.utils.data import DataLoader, TensorDataset
        from polytrain import TorchTrainer

        def model_creator(config):
            return torch.nn.Linear(4, 2)

        def data_creator(config):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 4, generator=g)
            return DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=config["batch_size"])

        def optimizer_creator(model, config):
            return torch.optim.SGD(model.parameters(), lr=0.1)

        ray.init(address="{address}")
        trainer = TorchTrainer(model_creator=model_creator, data_creator=data_creator,
                               optimizer_creator=optimizer_creator,
                               loss_creator=torch.nn.CrossEntropyLoss,
                               config={{"batch_size": 16}}, num_workers=2)
        print("LOSS", trainer.train()["loss"])
        trainer.shutdown()
    """)
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOSS" in result.stdout


# ---------------------------------------------------------------- errors


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown backend 'nope'.*'ddp'.*'horovod'"):
        TorchTrainer(**DIGITS, config={"batch_size": 8}, num_workers=2, backend="nope")


def test_bad_creator_return_names_the_creator(no_leftover_actors):
    def bad_model_creator(config):
        return "not a model"

    with pytest.raises(
        WorkerError, match=r"model_creator returned str .*expected a torch.nn.Module"
    ):
        TorchTrainer(
            **{**DIGITS, "model_creator": bad_model_creator},
            config={"batch_size": 8},
            num_workers=2,
        )


def test_creator_with_wrong_arguments_fails_at_construction():
    with pytest.raises(CreatorError, match="optimizer_creator .* cannot be called with 2"):
        TorchTrainer(
            **{**DIGITS, "optimizer_creator": lambda model: None},
            config={"batch_size": 8},
            num_workers=2,
        )


def test_insufficient_resources_fail_within_timeout(no_leftover_actors):
    start = time.monotonic()
    with pytest.raises(
        InsufficientResourcesError, match=r"Could not place 3 worker\(s\).*Available now"
    ):
        TorchTrainer(
            **DIGITS,
            config={"batch_size": 8},
            scaling_config={"num_workers": 3, "num_cpus_per_worker": 2, "start_timeout_s": 2},
        )
    assert time.monotonic() - start < 15


def test_gpu_request_without_gpus_fails_at_once(no_leftover_actors):
    with pytest.raises(InsufficientResourcesError, match="0 GPU in total.*use_gpu=False"):
        TorchTrainer(**DIGITS, config={"batch_size": 8}, num_workers=2, use_gpu=True)


class FailOnRankOne(TrainingOperator):
    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 2:
            raise ValueError("boom on purpose")
        return super().train_batch(batch, batch_info)


def test_worker_error_carries_rank_and_traceback_and_tears_down(no_leftover_actors):
    trainer = TorchTrainer(
        **DIGITS, training_operator_cls=FailOnRankOne, config={"batch_size": 16}, num_workers=2
    )
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        trainer.train()
    assert time.monotonic() - start < 30  # rank 0 was blocked in allreduce; no hang
    assert info.value.rank == 1
    assert "boom on purpose" in str(info.value)
    assert "train_batch" in info.value.remote_traceback
    with pytest.raises(TrainerShutdownError, match="shut down; create a new one"):
        trainer.train()


def test_every_call_after_shutdown_raises():
    trainer = TorchTrainer(**DIGITS, config={"batch_size": 16}, num_workers=1)
    trainer.shutdown()
    trainer.shutdown()  # idempotent
    for call in (
        trainer.train,
        trainer.validate,
        trainer.state_dict,
        trainer.get_model,
        lambda: trainer.save("x.pt"),
        lambda: trainer.load("x.pt"),
    ):
        with pytest.raises(TrainerShutdownError, match="shut down; create a new one"):
            call()
