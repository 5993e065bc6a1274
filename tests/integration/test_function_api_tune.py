"""Ray Tune over the function API: ``polytrain.tune.Tuner(trainer)`` with real trials and restores."""

from __future__ import annotations

import pytest

tune = pytest.importorskip("ray.tune")

import contextlib  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from polytrain.errors import ConfigError  # noqa: E402
from polytrain.train import (  # noqa: E402
    Checkpoint,
    RunConfig,
    ScalingConfig,
    get_checkpoint,
    get_context,
    report,
)
from polytrain.train import torch as train_torch  # noqa: E402
from polytrain.train.torch import TorchTrainer  # noqa: E402
from polytrain.train.tuning import trial_resources  # noqa: E402
from polytrain.tune import Tuner  # noqa: E402

# Tune's TensorBoard logger imports tensorboardX, which sets CRC32C_SW_MODE once per
# process: imported with this module, it stays out of the per-test env-leak guard.
with contextlib.suppress(ImportError):
    import tensorboardX  # noqa: F401

GOOD_LR, BAD_LR = 0.5, 1e-4


# Every test starts with an empty warm pool: Tune's trial actors and placement groups need free CPUs.
KEEP_WARM_POOL = False


def regression_loop(config):
    """Fits y = 3x with one linear layer; reports and checkpoints every epoch."""
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = 3 * x
    model = torch.nn.Linear(1, 1)
    start = 0
    checkpoint = get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        start = state["epoch"] + 1
    model = train_torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for epoch in range(start, config["epochs"]):
        failing = config["lr"] == config.get("fail_lr") and epoch == config.get("fail_at")
        if failing and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            raise RuntimeError("the trial fails once on purpose")
        for _ in range(20):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        in_group = ray.util.get_current_placement_group() is not None
        with tempfile.TemporaryDirectory() as d:
            if get_context().get_world_rank() == 0:
                state = {"model": model.module.state_dict(), "epoch": epoch}
                torch.save(state, os.path.join(d, "state.pt"))
            report(
                {
                    "loss": loss.item(),
                    "epoch": epoch,
                    "resumed": checkpoint is not None,
                    "trial": get_context().get_trial_name(),
                    "in_trial_group": in_group,
                },
                checkpoint=Checkpoint.from_directory(d),
            )


def _trainer(tmp_path, **loop_config):
    return TorchTrainer(
        regression_loop,
        train_loop_config={"epochs": 3, "lr": 0.5, **loop_config},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(storage_path=str(tmp_path), name="function_api"),
    )


def test_grid_search_picks_the_best_and_restores_a_failed_trial(
    tmp_path, ray_start_4_cpus, no_leftover_actors
):
    """Two trials at once; the bad one raises once in epoch 1 and resumes from epoch 0's checkpoint."""
    marker = str(tmp_path / "failed")
    tuner = Tuner(
        _trainer(tmp_path, fail_lr=BAD_LR, fail_at=1, marker=marker),
        # 1 CPU for the trial + 1 per worker: both trials run at once in 4 CPUs.
        param_space={"train_loop_config": {"lr": tune.grid_search([GOOD_LR, BAD_LR])}},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(
            name="grid",
            storage_path=str(tmp_path),
            failure_config=tune.FailureConfig(max_failures=1),
            verbose=0,
        ),
    )
    results = tuner.fit()

    assert len(results) == 2 and results.num_errors == 0 and os.path.exists(marker)
    for result in results:
        assert result.metrics["training_iteration"] == 3
        assert result.metrics["trial"] and result.metrics["in_trial_group"]
        assert result.checkpoint is not None
        with result.checkpoint.as_directory() as d:
            assert torch.load(os.path.join(d, "state.pt"), weights_only=True)["epoch"] == 2
        # Tune copied each checkpoint; the trial's own run kept only its newest one.
        run = os.path.join(result.path, "polytrain_run")
        assert len([n for n in os.listdir(run) if n.startswith("checkpoint_")]) == 1
    best = results.get_best_result()
    assert best.config["train_loop_config"]["lr"] == GOOD_LR
    assert best.metrics["loss"] < 1e-3
    assert list(best.metrics_dataframe["resumed"]) == [False, False, False]
    worst = results.get_best_result(mode="max")
    assert worst.metrics["loss"] > 0.1
    # The restored trial continues after epoch 0 (a fresh start would report 0, 0, 1, 2, all
    # unresumed, and 4 iterations). Only the rows after the restore are checked: Tune stages
    # result.json in its driver artifacts and, on restoring a trial, copies storage's copy
    # over it, which may predate the first result (Ray 2.60): the row of epoch 0 is then
    # lost from metrics_dataframe although the trial reported it.
    assert worst.metrics["training_iteration"] == 3 and worst.metrics["resumed"]
    assert list(worst.metrics_dataframe["epoch"])[-2:] == [1, 2]
    assert list(worst.metrics_dataframe["resumed"])[-2:] == [True, True]
    assert len(worst.metrics_dataframe) in (2, 3)


def test_the_trainers_run_config_names_the_experiment(tmp_path):
    from polytrain.tune import _default_run_config

    run_config = _default_run_config(tune, _trainer(tmp_path))
    assert (run_config.name, run_config.storage_path) == ("function_api", str(tmp_path))


def test_param_space_and_resources_are_checked():
    trainer = TorchTrainer(regression_loop, scaling_config={"num_workers": 2})
    with pytest.raises(ConfigError, match=r"keys \['lr'\].*allowed.*train_loop_config"):
        Tuner(trainer, param_space={"lr": tune.grid_search([0.1])})
    bundles = trial_resources(ScalingConfig(num_workers=2, num_cpus_per_worker=2)).bundles
    assert bundles == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    with pytest.raises(ConfigError, match=r"got 0 \(local mode.*Set num_workers >= 1"):
        TorchTrainer(regression_loop, scaling_config={"num_workers": 0}).as_trainable()
