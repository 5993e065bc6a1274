"""Ray Tune over polytrain trainers: ASHA, backend as a hyperparameter, failing trials, Lightning."""

from __future__ import annotations

import pytest

tune = pytest.importorskip("ray.tune")

import contextlib  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402

from examples import digits  # noqa: E402
from polytrain import TorchTrainer, TrainingOperator  # noqa: E402
from polytrain.backends.registry import available_backends  # noqa: E402
from polytrain.errors import ConfigError  # noqa: E402
from polytrain.tune import CHECKPOINT_FILE, tune_resources  # noqa: E402

# Every test starts with an empty warm pool: Tune's trial actors and placement groups need free CPUs.
KEEP_WARM_POOL = False


GOOD_LR = 0.2
# Far too small to learn anything in one epoch: ASHA must stop these at the first rung.
BAD_LRS = [1e-3, 3e-4, 1e-4]
# torch.optim.SGD raises on a negative learning rate: that trial fails on its workers.
FAILING_LR = -1.0

# Tune's TensorBoard logger imports tensorboardX (it sets CRC32C_SW_MODE) and Lightning
# sets PYTORCH_NVML_BASED_CUDA_CHECK, once per process on import: importing both with
# this module keeps those out of the per-test env-leak guard.
with contextlib.suppress(ImportError):
    import tensorboardX  # noqa: F401
with contextlib.suppress(ImportError):
    import pytorch_lightning  # noqa: F401


def _run_config(tmp_path, name):
    return tune.RunConfig(
        name=name,
        storage_path=str(tmp_path),
        verbose=0,
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
    )


def test_asha_searches_lr_and_backend(tmp_path, ray_start_4_cpus, no_leftover_actors):
    backends = [b for b in ("ddp", "horovod") if b in available_backends("torch")]
    trainable = TorchTrainer.as_trainable(
        model_creator=digits.model_creator,
        data_creator=digits.data_creator,
        optimizer_creator=digits.optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 64},
        num_workers=2,
        num_epochs=3,
    )
    tuner = tune.Tuner(
        trainable,
        param_space={
            # Grid order is trial order; one trial at a time fits in 4 CPUs (1 + 2 each).
            "lr": tune.grid_search([GOOD_LR, *BAD_LRS, FAILING_LR]),
            "backend": tune.choice(backends),
        },
        tune_config=tune.TuneConfig(
            metric="val_accuracy",
            mode="max",
            scheduler=ASHAScheduler(max_t=3, grace_period=1, reduction_factor=2),
        ),
        run_config=_run_config(tmp_path, "asha"),
    )
    results = tuner.fit()

    assert len(results) == 5
    assert results.num_errors == 1
    (error,) = results.errors
    assert "Invalid learning rate" in str(error)
    finished = [r for r in results if r.error is None]
    assert len(finished) == 4
    for result in finished:
        # The trial trained with the backend Tune chose for it.
        assert result.metrics["backend"] == result.config["backend"]
        assert result.checkpoint is not None
        with result.checkpoint.as_directory() as directory:
            state = torch.load(f"{directory}/{CHECKPOINT_FILE}", weights_only=True)
        assert state["backend"] == result.config["backend"]
        assert state["epoch"] == result.metrics["training_iteration"]
    iterations = {r.config["lr"]: r.metrics["training_iteration"] for r in finished}
    assert iterations[GOOD_LR] == 3
    assert any(iterations[lr] < 3 for lr in BAD_LRS), f"ASHA stopped nothing: {iterations}"

    best = results.get_best_result()
    assert best.config["lr"] == GOOD_LR
    assert best.metrics["val_accuracy"] > 0.85


def test_trial_options_are_split_from_config():
    from polytrain.tune import _scaling_of, _split_trial_config

    kwargs = _split_trial_config(
        {"lr": 0.1, "backend": "horovod", "num_workers": 3},
        {"config": {"batch_size": 64}, "num_workers": 2, "backend": "ddp"},
    )
    assert kwargs["config"] == {"batch_size": 64, "lr": 0.1}
    assert kwargs["backend"] == "horovod" and kwargs["num_workers"] == 3
    scaled = _split_trial_config({"num_workers": 4}, {"scaling_config": {"num_cpus_per_worker": 2}})
    assert "num_workers" not in scaled
    assert _scaling_of(scaled).num_workers == 4
    assert _scaling_of(scaled).num_cpus_per_worker == 2
    bundles = tune_resources(num_workers=2, num_cpus_per_worker=2).bundles
    assert bundles == [{"CPU": 1}, {"CPU": 2.0}, {"CPU": 2.0}]
    with pytest.raises(ConfigError, match="num_workers must be an int >= 1.*got 0"):
        TorchTrainer.as_trainable(model_creator=digits.model_creator, num_workers=0)
    with pytest.raises(ConfigError, match="num_epochs must be an int >= 1 or None; got 0"):
        TorchTrainer.as_trainable(num_workers=1, num_epochs=0)


def test_lightning_strategy_reports_to_tune(tmp_path, ray_start_4_cpus, no_leftover_actors):
    pl = pytest.importorskip("pytorch_lightning")
    from examples.lightning_mnist import DigitsClassifier, DigitsDataModule
    from polytrain.lightning import RayStrategy, TuneReportCallback

    def train_fn(config):
        pl.seed_everything(0, workers=True)  # the module's initial weights: a fixed start
        trainer = pl.Trainer(
            max_epochs=2,
            limit_train_batches=10,
            strategy=RayStrategy(num_workers=2),
            callbacks=[TuneReportCallback({"acc": "val_accuracy"})],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(DigitsClassifier(lr=config["lr"]), datamodule=DigitsDataModule())

    tuner = tune.Tuner(
        tune.with_resources(train_fn, tune_resources(num_workers=2)),
        param_space={"lr": 0.2},
        tune_config=tune.TuneConfig(metric="acc", mode="max"),
        run_config=_run_config(tmp_path, "lightning"),
    )
    (result,) = tuner.fit()
    assert result.error is None
    assert result.metrics["training_iteration"] == 2  # one report per validation run
    assert result.metrics["epoch"] == 1
    assert result.metrics["acc"] > 0.3  # 20 steps: learning has started (chance is 0.1)


class FailOnceInEpoch2(TrainingOperator):
    """Raises once, in the third epoch, so Tune must restore the trial from its checkpoint."""

    def train_batch(self, batch, batch_info):
        marker = self.config["fail_marker"]
        if batch_info["epoch"] == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("trial fails once on purpose")
        return super().train_batch(batch, batch_info)


def test_restored_trial_resumes_from_its_checkpoint(tmp_path, ray_start_4_cpus, no_leftover_actors):
    """Tune restarts a failed trial from its last checkpoint (the path PBT exploits take)."""
    trainable = TorchTrainer.as_trainable(
        model_creator=digits.model_creator,
        data_creator=digits.data_creator,
        optimizer_creator=digits.optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=FailOnceInEpoch2,
        config={"batch_size": 32, "fail_marker": str(tmp_path / "failed")},
        num_workers=1,
        num_epochs=4,
        num_steps=3,
    )
    run_config = _run_config(tmp_path, "restore")
    run_config.failure_config = tune.FailureConfig(max_failures=1)
    tuner = tune.Tuner(trainable, param_space={"lr": 0.1}, run_config=run_config)
    (result,) = tuner.fit()
    assert result.error is None
    assert (tmp_path / "failed").exists()
    # Fresh start would report epochs 1, 2, 1, 2, 3, 4; a restore continues after epoch 2.
    assert list(result.metrics_dataframe["epoch"]) == [1, 2, 3, 4]
