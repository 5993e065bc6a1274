"""Lightning on RayStrategy under real Ray Tune: checkpoints reported, best checkpoint, trial restore."""

from __future__ import annotations

import contextlib
import os

import pytest

tune = pytest.importorskip("ray.tune")
pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402

from examples.lightning_mnist import DigitsClassifier, DigitsDataModule  # noqa: E402
from polytrain.lightning import (  # noqa: E402
    RayStrategy,
    TuneReportCheckpointCallback,
    get_tune_resources,
)

# Tune's TensorBoard logger imports tensorboardX, which sets CRC32C_SW_MODE once per
# process: importing it here keeps that out of the per-test env-leak guard.
with contextlib.suppress(ImportError):
    import tensorboardX  # noqa: F401


# Every test starts with an empty warm pool: Tune's trial actors and placement groups need free CPUs.
KEEP_WARM_POOL = False


class FailOnceAtEpoch2(pl.Callback):
    """Rank 0 raises once, when epoch 2 starts: Tune must restore the trial from its checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if (
            trainer.current_epoch == 2
            and trainer.is_global_zero
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()
            raise RuntimeError("trial fails once on purpose")


def _train_fn(config: dict) -> None:
    trainer = pl.Trainer(
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        strategy=RayStrategy(num_workers=2),
        callbacks=[
            TuneReportCheckpointCallback({"acc": "val_accuracy"}, on="validation_end"),
            FailOnceAtEpoch2(config["marker"]),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model, data = DigitsClassifier(lr=config["lr"]), DigitsDataModule()
    checkpoint = tune.get_checkpoint()  # set when Tune restores the trial
    if checkpoint is None:
        trainer.fit(model, datamodule=data)
        return
    with checkpoint.as_directory() as directory:
        trainer.fit(model, datamodule=data, ckpt_path=os.path.join(directory, "checkpoint"))


def test_checkpoints_reach_tune_and_a_restored_trial_continues(
    tmp_path, ray_start_4_cpus, no_leftover_actors
):
    marker = tmp_path / "failed"
    tuner = tune.Tuner(
        tune.with_resources(_train_fn, get_tune_resources(num_workers=2)),
        param_space={"lr": 0.2, "marker": str(marker)},
        tune_config=tune.TuneConfig(metric="acc", mode="max"),
        run_config=tune.RunConfig(
            name="lightning_checkpoints",
            storage_path=str(tmp_path / "results"),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )
    results = tuner.fit()
    result = results.get_best_result()
    assert result.error is None
    assert marker.exists(), "the trial never failed: nothing was restored"

    # Epochs 0 and 1 before the failure; the restored trial goes on with epoch 2 (a
    # fresh start would report 0, 1, 0, 1, 2) and its global step continues.
    history = result.metrics_dataframe
    assert list(history["epoch"]) == [0, 1, 2]
    assert list(history["step"]) == [4, 8, 12]

    # Every report carried a checkpoint: Tune kept them, the best one included.
    assert result.checkpoint is not None and result.best_checkpoints
    best_checkpoint, best_metrics = max(result.best_checkpoints, key=lambda pair: pair[1]["acc"])
    with best_checkpoint.as_directory() as directory:
        assert os.listdir(directory) == ["checkpoint"]
        saved = torch.load(os.path.join(directory, "checkpoint"), weights_only=True)
    assert saved["epoch"] == best_metrics["epoch"]
    assert saved["global_step"] == best_metrics["step"]
    assert saved["state_dict"].keys() == DigitsClassifier().state_dict().keys()
    assert saved["optimizer_states"] and saved["lr_schedulers"]
