"""Warm workers through their callers (issue 14): every torch backend in turn, Lightning, Tune.

The same two worker processes train with each backend in turn (as ``polytrain
compare`` runs them), a Lightning ``fit`` and ``test`` share their workers, and
Tune trials of one trainable actor (``reuse_actors=True``) keep theirs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.registry import available_backends
from polytrain.launchers.pool import warm_pool as pool
from tests.helpers import parity_data_creator, parity_model_creator, parity_optimizer_creator

# Every test starts with an empty warm pool: these tests count the pool's own groups and reuses.
KEEP_WARM_POOL = False


BACKEND_CONFIGS = {"deepspeed": {"stage": 2}, "fairscale": {"mode": "sddp"}}


@pytest.fixture(autouse=True)
def empty_pool():
    pool.clear()
    yield
    pool.clear()


def _trainer(backend: str) -> TorchTrainer:
    return TorchTrainer(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        optimizer_creator=parity_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 64},
        num_workers=2,
        backend=backend,
        backend_config=BACKEND_CONFIGS.get(backend),
    )


def test_every_torch_backend_trains_in_turn_on_the_same_workers(ray_start_4_cpus):
    backends = [
        b
        for b in ("ddp", "horovod", "fairscale", "fsdp", "deepspeed", "ddp")
        if b in available_backends("torch")
    ]
    losses, pids = {}, []
    for backend in backends:
        trainer = _trainer(backend)
        try:
            losses.setdefault(backend, []).append(trainer.train(num_steps=4)["loss"])
            pids.append(trainer.apply_all_workers(os.getpid))
            assert trainer._group.reused == (len(pids) > 1)
        finally:
            trainer.shutdown()
    assert all(p == pids[0] for p in pids)
    # Same data, same seeded model, plain SGD: every backend's 4 steps give DDP's loss.
    reference = losses["ddp"][0]
    for backend, values in losses.items():
        for value in values:
            assert value == pytest.approx(reference, rel=1e-4), backend


# ------------------------------------------------------------------ Lightning
def test_lightning_fit_then_test_share_the_workers(ray_start_4_cpus, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from examples.lightning_mnist import DigitsClassifier, DigitsDataModule
    from polytrain.lightning import RayStrategy

    class RecordPids(pl.Callback):
        def _record(self, trainer, stage: str) -> None:
            path = tmp_path / f"{stage}-{trainer.global_rank}.json"
            path.write_text(json.dumps(os.getpid()))

        def on_train_start(self, trainer, pl_module) -> None:
            self._record(trainer, "fit")

        def on_test_start(self, trainer, pl_module) -> None:
            self._record(trainer, "test")

    trainer = pl.Trainer(
        strategy=RayStrategy(num_workers=2),
        max_steps=2,
        limit_val_batches=0,
        limit_test_batches=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[RecordPids()],
    )
    model, data = DigitsClassifier(), DigitsDataModule()
    trainer.fit(model, data)
    assert pool.idle_workers() == 2
    trainer.test(model, data)
    fit = {json.loads(p.read_text()) for p in tmp_path.glob("fit-*.json")}
    test = {json.loads(p.read_text()) for p in tmp_path.glob("test-*.json")}
    assert len(fit) == 2 and fit == test


# ----------------------------------------------------------------------- Tune
class PidOperator(TrainingOperator):
    """Reports the sum of the workers' pids: equal between trials on the same workers."""

    def train_batch(self, batch, batch_info):
        return {**super().train_batch(batch, batch_info), "worker_pid": os.getpid()}


def test_tune_trials_of_a_reused_trainable_keep_their_workers(ray_start_4_cpus, tmp_path):
    tune = pytest.importorskip("ray.tune")
    trainable = TorchTrainer.as_trainable(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        optimizer_creator=parity_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=PidOperator,
        config={"batch_size": 64},
        num_workers=2,
        num_epochs=1,
        num_steps=2,
        validate=False,
    )
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.1, 0.05, 0.01])},
        tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    pids = [r.metrics["worker_pid"] for r in results]
    assert len(pids) == 3 and len(set(pids)) == 1, pids
    assert Path(tmp_path).exists()
