"""The horovod backend on real Ray workers: options, checkpoints, failures, local mode.

The shared suite (test_backend_suite.py) covers training, parity with DDP, the
checkpoint saved under horovod loading under ddp, a worker error and local mode;
these tests cover what is specific to Horovod.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.horovod.backend import HorovodBackend
from polytrain.backends.registry import get_spec
from polytrain.errors import TrainerShutdownError, WorkerDiedError, WorkerError
from tests.helpers import (
    DIGITS,
    adam_optimizer_creator,
    max_param_diff,
    parity_data_creator,
    parity_dataset,
    parity_model_creator,
    parity_optimizer_creator,
    plain_reference,
)

pytestmark = [
    pytest.mark.skipif(not get_spec("horovod").installed, reason="horovod is not installed"),
    pytest.mark.usefixtures("ray_start_4_cpus"),
]

GLOBAL_BATCH = 32
BATCHES_PER_EPOCH = 512 // GLOBAL_BATCH  # tests.helpers.PARITY_SAMPLES // GLOBAL_BATCH


def _parity_trainer(backend="horovod", backend_config=None, lr=0.1, **kwargs) -> TorchTrainer:
    kwargs.setdefault("optimizer_creator", parity_optimizer_creator)
    return TorchTrainer(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"lr": lr, "batch_size": GLOBAL_BATCH},
        num_workers=kwargs.pop("num_workers", 2),
        backend=backend,
        backend_config=backend_config,
        **kwargs,
    )


def _train_and_get_model(trainer: TorchTrainer, epochs: int = 2) -> torch.nn.Module:
    try:
        for _ in range(epochs):
            trainer.train()
        return trainer.get_model()
    finally:
        trainer.shutdown()


def accumulated_reference(
    optimizer_steps: int,
    micro_batches: int = 1,
    optimizer_creator=parity_optimizer_creator,
    lr: float = 0.1,
) -> torch.nn.Module:
    """Single process: each step sums the gradients of ``micro_batches`` global batches."""
    model = parity_model_creator({})
    optimizer = optimizer_creator(model, {"lr": lr})
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(parity_dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    batches = [b for _ in range(optimizer_steps * micro_batches // len(loader) + 1) for b in loader]
    for step in range(optimizer_steps):
        optimizer.zero_grad()
        for x, y in batches[step * micro_batches : (step + 1) * micro_batches]:
            loss_fn(model(x), y).backward()
        optimizer.step()
    return model


# ----------------------------------------------------------------- options
def test_fp16_compression_trains_close_to_exact():
    model = _train_and_get_model(_parity_trainer(backend_config={"compression": "fp16"}))
    diff = max_param_diff(model, plain_reference(2 * BATCHES_PER_EPOCH, GLOBAL_BATCH))
    # float16 gradients on the wire: not bit-exact, but within fp16 rounding of it
    assert 0 < diff < 1e-2, diff


def test_sum_op_is_average_times_world_size():
    exact = plain_reference(2 * BATCHES_PER_EPOCH, GLOBAL_BATCH, lr=0.1)
    summed_half_lr = _train_and_get_model(_parity_trainer(backend_config={"op": "sum"}, lr=0.05))
    summed = _train_and_get_model(_parity_trainer(backend_config={"op": "sum"}, lr=0.1))
    # two workers: the summed gradient is twice the average, so lr/2 reproduces it
    assert max_param_diff(summed_half_lr, exact) <= 1e-5
    assert max_param_diff(summed, exact) > 1e-3


class AccumulateTwoWithNoSync(TrainingOperator):
    """DDP-style accumulation written once for every backend: even batches skip the sync."""

    def train_batch(self, batch, batch_info):
        x, y = batch
        loss = self.criterion(self.model(x), y)
        if batch_info["batch_idx"] % 2 == 0:
            self.zero_grad()
            with self.no_sync():
                self.backward(loss)
        else:
            self.backward(loss)
            self.step()
        return {"loss": loss.item(), "num_samples": len(y)}


def test_gradient_accumulation_matches_ddp_no_sync_and_reference():
    """Every optimizer step applies the worker average of the gradients summed over 2 batches.

    That is the single-process loop that sums the gradients of two global batches
    before each step, and what DDP computes with ``no_sync`` on every other batch.
    """
    steps = 3 * BATCHES_PER_EPOCH // 2  # 24 optimizer steps over 48 batches
    reference = accumulated_reference(steps, micro_batches=2)
    accumulated = _train_and_get_model(
        _parity_trainer(backend_config={"backward_passes_per_step": 2}), epochs=3
    )
    hvd_no_sync = _train_and_get_model(
        _parity_trainer(training_operator_cls=AccumulateTwoWithNoSync), epochs=3
    )
    ddp_no_sync = _train_and_get_model(
        _parity_trainer("ddp", training_operator_cls=AccumulateTwoWithNoSync), epochs=3
    )
    assert max_param_diff(ddp_no_sync, reference) <= 1e-5
    assert max_param_diff(accumulated, reference) <= 1e-5
    assert max_param_diff(hvd_no_sync, reference) <= 1e-5
    # and accumulation changed the trajectory: one step per batch lands elsewhere
    assert max_param_diff(accumulated, plain_reference(steps, GLOBAL_BATCH)) > 1e-3


def test_adam_parity_with_reference_and_host_staging_path():
    """Adam's state starts empty on every rank (no zero-gradient warm-up step), as under DDP.

    The host-staging path (GPU tensors through host memory, for a Horovod built
    without CUDA) is forced on CPU here so its broadcasts and compression run.
    """

    class Staged(HorovodBackend):
        force_host_staging = True

    exact = accumulated_reference(2 * BATCHES_PER_EPOCH, optimizer_creator=adam_optimizer_creator)
    hvd_adam = _train_and_get_model(_parity_trainer(optimizer_creator=adam_optimizer_creator))
    staged = _train_and_get_model(
        _parity_trainer(Staged(), optimizer_creator=adam_optimizer_creator)
    )
    assert max_param_diff(hvd_adam, exact) <= 1e-5
    assert max_param_diff(staged, exact) <= 1e-5


# ------------------------------------------------------------- checkpoints
def test_checkpoint_saved_under_ddp_resumes_under_horovod(tmp_path):
    config = {"lr": 1e-3, "batch_size": 64}
    digits_adam = {**DIGITS, "optimizer_creator": adam_optimizer_creator}
    ddp = TorchTrainer(**digits_adam, config=config, num_workers=2, backend="ddp")
    try:
        ddp.train()
        path = ddp.save(tmp_path / "ddp.pt")
        val = ddp.validate()
        ddp.train()  # one more epoch from the checkpoint, for comparison
        ddp_model = ddp.get_model()
    finally:
        ddp.shutdown()

    hvd_trainer = TorchTrainer(**digits_adam, config=config, num_workers=2, backend="hvd")
    try:
        hvd_trainer.load(path)
        assert abs(hvd_trainer.validate()["val_loss"] - val["val_loss"]) <= 1e-5
        loaded = hvd_trainer.get_model()
        hvd_trainer.train()  # Adam's moments came from the checkpoint
        hvd_model = hvd_trainer.get_model()
        state = hvd_trainer.state_dict()
    finally:
        hvd_trainer.shutdown()
    assert type(loaded) is torch.nn.Sequential
    assert max_param_diff(hvd_model, ddp_model) <= 1e-5
    # the saved optimizer state is plain torch format
    adam_state = state["optimizers"][0]
    assert set(adam_state) == {"state", "param_groups"}
    assert set(adam_state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


# --------------------------------------------------------------- failures
class DieInsideAllreduce(TrainingOperator):
    """Rank 1 dies after rank 0 has entered the gradient allreduce of batch 1."""

    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            time.sleep(1.0)  # rank 0 is blocked in the allreduce by now
            os._exit(1)
        return super().train_batch(batch, batch_info)


class RaiseDuringBackward(TrainingOperator):
    """Rank 1 raises in the middle of a backward pass, after some allreduces started."""

    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            first_weight = next(self.model.parameters())

            def fail(grad):
                raise RuntimeError("rank one fails inside the collective")

            first_weight.register_hook(fail)
        return super().train_batch(batch, batch_info)


@pytest.mark.parametrize(
    ("operator", "error", "match"),
    [
        (RaiseDuringBackward, WorkerError, "rank one fails inside the collective"),
        (DieInsideAllreduce, WorkerDiedError, "died"),
    ],
    ids=["raise", "die"],
)
def test_failure_inside_collective_reaches_driver_without_hang(
    operator, error, match, no_leftover_actors
):
    trainer = TorchTrainer(
        **DIGITS,
        training_operator_cls=operator,
        config={"batch_size": 32},
        num_workers=2,
        backend="horovod",
        # The error itself must arrive: recovery (on by default) would replace the worker.
        failure_config={"max_retries": 0},
    )
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        trainer.train()
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert elapsed < 30, elapsed
    with pytest.raises(TrainerShutdownError):
        trainer.train()


# ----------------------------------------- metrics, tqdm, custom operators
def _horovod_placement() -> tuple[int, int, int, str]:
    import horovod.torch as hvd

    return hvd.rank(), hvd.size(), hvd.local_rank(), os.environ["HOROVOD_CONTROLLER"]


class TwoModelOperator(TrainingOperator):
    """Two models, two optimizers and an extra metric, as a custom step would have."""

    def train_batch(self, batch, batch_info):
        x, y = batch
        encoder, head = self.models
        logits = head(encoder(x))
        loss = self.criterion(logits, y)
        penalty = 1e-4 * sum(p.pow(2).sum() for p in encoder.parameters())
        self.zero_grad()
        self.backward(loss + penalty)
        self.step()
        return {"loss": loss.item(), "penalty": penalty.item(), "num_samples": len(y)}


def _two_models(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()), torch.nn.Linear(32, 10)


def _two_optimizers(models, config):
    return tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in models)


def _step_lrs(optimizers, config):
    return tuple(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers)


def _run_custom(backend: str, use_tqdm: bool) -> tuple[list[dict], dict, tuple, list]:
    trainer = TorchTrainer(
        model_creator=_two_models,
        data_creator=DIGITS["data_creator"],
        optimizer_creator=_two_optimizers,
        loss_creator=torch.nn.CrossEntropyLoss,
        scheduler_creator=_step_lrs,
        scheduler_step_freq="epoch",
        training_operator_cls=TwoModelOperator,
        config={"batch_size": 64},
        num_workers=2,
        backend=backend,
        use_tqdm=use_tqdm,
    )
    try:
        stats = [trainer.train(), trainer.train()]
        val = trainer.validate()
        models = trainer.get_model()
        placement = trainer.apply_all_workers(_horovod_placement) if backend == "horovod" else []
        lrs = [s["param_groups"][0]["lr"] for s in trainer.state_dict()["optimizers"]]
    finally:
        trainer.shutdown()
    return stats, val, models, placement + [lrs]


def test_metrics_tqdm_scheduler_and_custom_operator_as_with_ddp(capsys):
    hvd_stats, hvd_val, hvd_models, hvd_extra = _run_custom("horovod", use_tqdm=True)
    assert "epoch 1" in capsys.readouterr().err  # rank 0's progress bar on the driver
    ddp_stats, ddp_val, ddp_models, ddp_extra = _run_custom("ddp", use_tqdm=False)

    *placement, hvd_lrs = hvd_extra
    assert placement == [(0, 2, 0, "gloo"), (1, 2, 1, "gloo")]  # Horovod ranks = world ranks
    assert hvd_lrs == ddp_extra[-1] == [pytest.approx(0.025)] * 2  # the scheduler drove both
    for hvd_epoch, ddp_epoch in zip(hvd_stats, ddp_stats, strict=True):
        assert hvd_epoch.keys() == ddp_epoch.keys()
        for key in ("loss", "penalty", "num_samples", "num_steps"):
            assert hvd_epoch[key] == pytest.approx(ddp_epoch[key], abs=1e-5), key
    assert hvd_val.keys() == ddp_val.keys()
    assert hvd_val["val_loss"] == pytest.approx(ddp_val["val_loss"], abs=1e-5)
    for hvd_model, ddp_model in zip(hvd_models, ddp_models, strict=True):
        assert max_param_diff(hvd_model, ddp_model) <= 1e-5


# -------------------------------------------------------------- local mode
def test_local_mode_twice_in_a_row_and_leaves_no_horovod_running():
    import horovod.torch as hvd

    assert not hvd.is_initialized()
    horovod_env_before = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    for _ in range(2):  # hvd.init() -> shutdown() -> init() in one process
        trainer = TorchTrainer(
            **DIGITS,
            config={"lr": 0.1, "batch_size": 32},
            num_workers=0,
            backend="horovod",
            backend_config={"backward_passes_per_step": 2},
        )
        try:
            assert hvd.is_initialized() and hvd.size() == 1
            first = trainer.train(num_steps=20)
            second = trainer.train(num_steps=20)
        finally:
            trainer.shutdown()
        assert second["loss"] < first["loss"]
        assert not hvd.is_initialized()
    assert {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")} == horovod_env_before


def test_local_mode_keeps_a_horovod_the_user_started():
    import horovod.torch as hvd

    hvd.init()
    try:
        trainer = TorchTrainer(
            **DIGITS, config={"batch_size": 32}, num_workers=0, backend="horovod"
        )
        trainer.train(num_steps=2)
        trainer.shutdown()
        assert hvd.is_initialized()
    finally:
        hvd.shutdown()
