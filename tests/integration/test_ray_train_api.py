"""Ray Train's helpers on real Ray workers: AMP, reproducibility, devices, validation tasks, Lightning.

Each training claim is an equality: ``accelerate(amp=True)`` trains exactly as the
trainer's ``use_fp16=True`` (the backend's mixed precision) and not as full precision;
two runs under ``enable_reproducibility`` with shuffled multi-process loaders end
bit-equal; a ``pl.Trainer`` built in the loop with ``RayDDPStrategy`` on 2 workers ends
with the weights of one process trained on the same global batches.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from polytrain import train
from polytrain.train import (
    Checkpoint,
    ReportedCheckpointStatus,
    RunConfig,
    ScalingConfig,
    ValidationConfig,
    ValidationTaskConfig,
)
from polytrain.train.torch import TorchTrainer

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

STEPS = 4


def _data(seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _save(model: torch.nn.Module) -> None:
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    with tempfile.TemporaryDirectory() as directory:
        torch.save(state, os.path.join(directory, "model.pt"))
        train.report({}, checkpoint=Checkpoint.from_directory(directory))


def _weights(result) -> dict:
    with result.checkpoint.as_directory() as directory:
        return torch.load(os.path.join(directory, "model.pt"), weights_only=True)


def amp_loop(config):
    if config["accelerate"]:
        train.torch.accelerate(amp=True)
    model = train.torch.prepare_model(_model())
    optimizer = train.torch.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = train.torch.prepare_data_loader(torch.utils.data.DataLoader(_data(), batch_size=8))
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        if config["accelerate"]:  # Ray Train 1.x's way: the prepared model casts itself
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        else:  # polytrain's way: the backend's autocast around the forward
            with train.torch.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
        train.torch.backward(loss)
        optimizer.step()
    _save(model if not config["accelerate"] else model.module)


def test_accelerate_amp_trains_as_the_backends_mixed_precision(tmp_path):
    def fit(accelerate: bool, use_fp16: bool, name: str):
        return TorchTrainer(
            amp_loop,
            train_loop_config={"accelerate": accelerate},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=str(tmp_path), name=name),
            use_fp16=use_fp16,
        ).fit()

    accelerated = _weights(fit(True, False, "accelerate"))
    fp16 = _weights(fit(False, True, "use_fp16"))
    full = _weights(fit(False, False, "full"))
    for key in fp16:
        assert torch.equal(accelerated[key], fp16[key]), key
    assert any(not torch.equal(accelerated[k], full[k]) for k in full)  # it did cast


def reproducible_loop(config):
    train.torch.enable_reproducibility(seed=7)
    assert train.torch.get_devices() == [torch.device("cpu")]
    model = train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=True, num_workers=1)
    )
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    _save(model)


def test_enable_reproducibility_makes_two_runs_equal(tmp_path):
    runs = [
        _weights(
            TorchTrainer(
                reproducible_loop,
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(storage_path=str(tmp_path), name=f"run{i}"),
            ).fit()
        )
        for i in range(2)
    ]
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def _slow_validation(checkpoint, delay_s=0.0):
    time.sleep(delay_s)
    return {"validated_at": time.time()}


def validated_loop():
    for i in range(3):
        with tempfile.TemporaryDirectory() as directory:
            # Report 1's validation sleeps past its timeout; the others finish at once.
            spec = ValidationTaskConfig(fn_kwargs={"delay_s": 30}, timeout_s=1) if i == 1 else True
            train.report({"i": i}, checkpoint=Checkpoint.from_directory(directory), validation=spec)
    # The loop is still running: the default consistency mode waits for the validations.
    statuses = {c.metrics["i"]: c.status for c in train.get_all_reported_checkpoints()}
    assert statuses == {
        0: ReportedCheckpointStatus.VALIDATED,
        1: ReportedCheckpointStatus.VALIDATION_TIMEOUT,
        2: ReportedCheckpointStatus.VALIDATED,
    }, statuses


def test_validation_tasks_run_while_training_goes_on(tmp_path):
    result = TorchTrainer(
        validated_loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="validated"),
        validation_config=ValidationConfig(_slow_validation),
    ).fit()
    validated = ["validated_at" in m for _, m in result.best_checkpoints]
    assert validated == [True, False, True]  # the timed-out one kept its training metrics


# ----------------------------------------------------------------- Lightning in the loop
GLOBAL_BATCH = 16


def _lightning_module():
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression()


def lightning_loop(config):
    import pytorch_lightning as pl

    from polytrain.train.lightning import (
        RayDDPStrategy,
        RayLightningEnvironment,
        RayTrainReportCallback,
        prepare_trainer,
    )

    world = train.get_context().get_world_size()
    loader = torch.utils.data.DataLoader(_data(), batch_size=GLOBAL_BATCH // world)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(_lightning_module(), train_dataloaders=loader)


class GlobalBatches:
    """The union of 2 ranks' batches under Lightning's ``DistributedSampler(shuffle=True)``."""

    def __init__(self) -> None:
        self.epoch = 0  # Lightning iterates a training loader once per epoch

    def __len__(self) -> int:
        return len(_data()) // GLOBAL_BATCH

    def __iter__(self):
        per_rank = GLOBAL_BATCH // 2
        shares = []
        for rank in range(2):
            sampler = torch.utils.data.DistributedSampler(_data(), num_replicas=2, rank=rank)
            sampler.set_epoch(self.epoch)
            shares.append(list(sampler))
        self.epoch += 1
        for k in range(len(self)):
            yield [i for share in shares for i in share[k * per_rank : (k + 1) * per_rank]]


def test_lightning_ray_ddp_strategy_in_the_loop_matches_one_process(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    result = TorchTrainer(
        lightning_loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="lightning"),
    ).fit()
    assert [m["epoch"] for m in result.metrics_history] == [0, 1]
    with result.checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "checkpoint.ckpt"), weights_only=False)
    module = _lightning_module()
    reference = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    # Lightning shuffles a distributed training loader (DistributedSampler, seed 0, one
    # permutation per epoch): one process steps through the same global batches.
    reference.fit(module, torch.utils.data.DataLoader(_data(), batch_sampler=GlobalBatches()))
    for key, value in module.state_dict().items():
        assert torch.allclose(state["state_dict"][key], value, atol=1e-6), key
