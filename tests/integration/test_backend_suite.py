"""The shared backend test-suite: the same tests, parametrized over every torch backend.

A case is skipped only when its backend's package is not installed; CI installs
every backend, so there every case runs.
"""

from __future__ import annotations

import time

import pytest
import torch

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.registry import describe_backends, get_spec
from polytrain.errors import WorkerError
from tests.helpers import (
    DIGITS,
    max_param_diff,
    parity_data_creator,
    parity_model_creator,
    parity_optimizer_creator,
)

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

# (id, backend, backend_config, parity tolerance vs 2-worker DDP), from the registry: a
# backend's test cases are part of its registry entry.
CASES = [
    (case.id, spec.name, case.backend_config, case.parity_tol)
    for spec in describe_backends()
    if spec.framework == "torch"
    for case in spec.test_cases
]


# The cases each test runs in every run; the others are marked long_matrix (make test-long).
# SGD parity of the sharded backends repeats what their Adam parity tests prove
# (test_fairscale_fsdp.py, test_deepspeed.py, every stage); a worker error is caught by
# the same code for every torch.distributed backend, so one of each family runs: ddp,
# Horovod, and DeepSpeed (whose engine wraps the step).
PARITY_EVERY_RUN = {"horovod"}
ERROR_EVERY_RUN = {"ddp", "horovod", "deepspeed-zero3"}


def _params(cases=CASES, every_run=None):
    params = []
    for case_id, backend, config, tol in cases:
        spec = get_spec(backend)
        marks = [pytest.mark.skipif(not spec.installed, reason=f"{backend} is not installed")]
        if every_run is not None and case_id not in every_run:
            marks.append(pytest.mark.long_matrix)
        params.append(pytest.param(backend, config, tol, id=case_id, marks=marks))
    return params


@pytest.mark.parametrize(("backend", "backend_config", "tol"), _params())
def test_trains_digits_and_checkpoint_loads_under_ddp(backend, backend_config, tol, tmp_path):
    config = {"lr": 0.1, "batch_size": 64}
    trainer = TorchTrainer(
        **DIGITS, config=config, num_workers=2, backend=backend, backend_config=backend_config
    )
    try:
        first = trainer.train()
        for _ in range(2):
            last = trainer.train()
        val = trainer.validate()
        path = trainer.save(tmp_path / f"{backend}.pt")
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert last["loss"] < first["loss"] * 0.6, (first, last)
    assert val["val_accuracy"] > 0.8
    assert type(model) is torch.nn.Sequential  # the user's module, unwrapped

    # the consolidated checkpoint loads under ddp at another world size
    other = TorchTrainer(**DIGITS, config=config, num_workers=1, backend="ddp")
    try:
        other.load(path)
        assert abs(other.validate()["val_loss"] - val["val_loss"]) <= 1e-5
    finally:
        other.shutdown()


@pytest.mark.parametrize(
    ("backend", "backend_config", "tol"), _params(CASES[1:], every_run=PARITY_EVERY_RUN)
)
def test_parity_with_ddp(backend, backend_config, tol):
    """Same seed, data order and global batch: parameters match 2-worker DDP after 32 SGD steps."""

    def run(name, cfg):
        trainer = TorchTrainer(
            model_creator=parity_model_creator,
            data_creator=parity_data_creator,
            optimizer_creator=parity_optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"lr": 0.1, "batch_size": 32},
            num_workers=2,
            backend=name,
            backend_config=cfg,
        )
        try:
            trainer.train()
            trainer.train()
            return trainer.get_model()
        finally:
            trainer.shutdown()

    assert max_param_diff(run(backend, backend_config), run("ddp", None)) <= max(tol, 1e-6)


class RaiseOnRankOne(TrainingOperator):
    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            raise RuntimeError("rank one fails on purpose")
        return super().train_batch(batch, batch_info)


@pytest.mark.parametrize(("backend", "backend_config", "tol"), _params(every_run=ERROR_EVERY_RUN))
def test_worker_error_reaches_driver_without_hang(backend, backend_config, tol, no_leftover_actors):
    trainer = TorchTrainer(
        **DIGITS,
        training_operator_cls=RaiseOnRankOne,
        config={"batch_size": 32},
        num_workers=2,
        backend=backend,
        backend_config=backend_config,
    )
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank one fails on purpose") as info:
        trainer.train()
    assert info.value.rank == 1
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(("backend", "backend_config", "tol"), _params())
def test_local_mode(backend, backend_config, tol):
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 32},
        num_workers=0,
        backend=backend,
        backend_config=backend_config,
    )
    try:
        first = trainer.train(num_steps=20)
        second = trainer.train(num_steps=20)
        assert second["loss"] < first["loss"]
        assert isinstance(trainer.get_model(), torch.nn.Module)
    finally:
        trainer.shutdown()
