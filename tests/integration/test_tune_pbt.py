"""Population Based Training over ``TorchTrainer.as_trainable`` (issue 29, item 5).

Two trials of one worker each run side by side on the session's 4 CPUs (1 CPU for
each trial's process, 1 for its worker) and report after a few batches of digits.
PBT compares them after every report: the worse one takes the better one's
checkpoint and continues with a mutated ``lr``. The worker reports the learning rate
its optimizer really used, so a mutation that the restored optimizer state silently
overrides fails here.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest

tune = pytest.importorskip("ray.tune")

import torch  # noqa: E402
from ray.tune.schedulers import PopulationBasedTraining  # noqa: E402

from examples import digits  # noqa: E402
from polytrain import TorchTrainer, TrainingOperator  # noqa: E402

# Tune's TensorBoard logger imports tensorboardX, which sets CRC32C_SW_MODE once per process.
with contextlib.suppress(ImportError):
    import tensorboardX  # noqa: F401

GOOD_LR, BAD_LR = 0.3, 1e-4  # after 5 steps: val accuracy well above chance / at chance
# Every test starts with an empty warm pool: Tune's trial actors and placement groups need free CPUs.
KEEP_WARM_POOL = False
ITERATIONS = 3


class ReportsLr(TrainingOperator):
    """The default step, plus the learning rate the optimizer stepped with."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        metrics = super().train_batch(batch, batch_info)
        return {**metrics, "lr_used": self.optimizer.param_groups[0]["lr"]}


def test_pbt_exploits_a_checkpoint_and_the_mutated_lr_takes_effect(
    tmp_path, ray_start_4_cpus, no_leftover_actors
):
    trainable = TorchTrainer.as_trainable(
        model_creator=digits.model_creator,
        data_creator=digits.data_creator,
        optimizer_creator=digits.optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        training_operator_cls=ReportsLr,
        config={"batch_size": 32},
        num_workers=1,
        num_epochs=ITERATIONS,
        num_steps=5,
    )
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=1,
        hyperparam_mutations={"lr": tune.uniform(1e-4, 1.0)},
        quantile_fraction=0.5,  # of 2 trials: the worse one exploits the better one
        resample_probability=0.0,  # the clone's lr times 0.8 or 1.2: never an initial value
        synch=True,
    )
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([GOOD_LR, BAD_LR])},
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", scheduler=pbt),
        run_config=tune.RunConfig(
            name="pbt",
            storage_path=str(tmp_path),
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=4),
            stop={"training_iteration": ITERATIONS},
        ),
    )
    results = tuner.fit()

    assert results.num_errors == 0, results.errors
    assert len(results) == 2
    policies = [
        json.loads(line)
        for path in Path(results.experiment_path).rglob("pbt_global.txt")
        for line in path.read_text().splitlines()
    ]
    assert policies, "PBT perturbed no trial"
    # [target tag, clone tag, target iteration, clone iteration, clone's config, new config]
    first = policies[0]
    assert first[0] != first[1] and first[4]["lr"] == GOOD_LR
    assert first[5]["lr"] == pytest.approx(GOOD_LR * 0.8) or first[5]["lr"] == pytest.approx(
        GOOD_LR * 1.2
    )

    mutated = 0
    for result in results:
        last = result.metrics
        assert last["epoch"] == ITERATIONS
        for key in ("loss", "val_loss", "val_accuracy", "lr_used"):
            assert math.isfinite(last[key]), (key, last[key])
        # The lr the worker stepped with is the trial's config of that report, also after
        # an exploit restored the other trial's optimizer state (the stop criterion keeps
        # PBT from exploiting after the last report, which would change the config alone).
        configured = last["config"]["lr"]
        assert last["lr_used"] == pytest.approx(configured, rel=1e-6)
        mutated += configured not in (GOOD_LR, BAD_LR)
    assert mutated >= 1, "no trial reported with a mutated lr"
    assert results.get_best_result().metrics["val_accuracy"] > 0.5
