"""ray_lightning-era options on TorchTrainer workers: DDP keyword arguments, CPU resources, error types."""

from __future__ import annotations

import pytest
import torch

from examples import digits
from polytrain import TorchTrainer, TrainingOperator
from polytrain.errors import WorkerError
from polytrain.launchers.scaling import ScalingConfig


class WithUnusedLayer(torch.nn.Module):
    """Digits MLP with a layer its forward never uses: DDP needs find_unused_parameters=True."""

    def __init__(self) -> None:
        super().__init__()
        self.net = digits.model_creator({})
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _trainer(**kwargs) -> TorchTrainer:
    options = {
        "model_creator": lambda config: WithUnusedLayer(),
        "data_creator": digits.data_creator,
        "optimizer_creator": digits.optimizer_creator,
        "loss_creator": torch.nn.CrossEntropyLoss,
        "config": {"lr": 0.05, "batch_size": 32},
        "backend": "ddp",
    }
    options.update(kwargs)
    return TorchTrainer(**options)


def _ddp_settings(operator: TrainingOperator) -> tuple[str, bool, int]:
    model = operator.model
    return type(model).__name__, model.find_unused_parameters, model.bucket_bytes_cap


def test_ddp_kwargs_reach_the_ddp_wrapper(ray_start_4_cpus, no_leftover_actors):
    trainer = _trainer(
        num_workers=2,
        backend_config={"ddp_kwargs": {"find_unused_parameters": True, "bucket_cap_mb": 2}},
    )
    try:
        settings = trainer.apply_all_operators(_ddp_settings)
        assert settings == [("DistributedDataParallel", True, 2 * 1024 * 1024)] * 2
        # The unused layer gets no gradient: DDP without find_unused_parameters would
        # fail at the second step waiting for it.
        stats = trainer.train(num_steps=3)
        assert stats["num_steps"] == 3
    finally:
        trainer.shutdown()


def _threads_and_cpus() -> tuple[int, float]:
    import ray

    return torch.get_num_threads(), ray.get_runtime_context().get_assigned_resources()["CPU"]


def test_cpu_resources_set_the_actor_cpus_and_threads(ray_start_4_cpus, no_leftover_actors):
    trainer = _trainer(
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}),
        backend_config={"find_unused_parameters": True},
    )
    try:
        assert trainer.apply_all_workers(_threads_and_cpus) == [(2, 2.0), (2, 2.0)]
    finally:
        trainer.shutdown()


class RaisesValueError(TrainingOperator):
    """Raises a ValueError on rank 1 at its second batch."""

    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            raise ValueError("bad value on rank 1")
        return super().train_batch(batch, batch_info)


def test_value_error_in_train_batch_is_a_value_error(ray_start_4_cpus, no_leftover_actors):
    trainer = _trainer(
        num_workers=2,
        training_operator_cls=RaisesValueError,
        backend_config={"find_unused_parameters": True},
    )
    try:
        with pytest.raises(ValueError, match="bad value on rank 1") as info:
            trainer.train(num_steps=3)
    finally:
        trainer.shutdown()
    assert isinstance(info.value, WorkerError)
    assert info.value.rank == 1
    assert "train_batch" in info.value.remote_traceback
    assert "ValueError: bad value on rank 1" in info.value.remote_traceback
