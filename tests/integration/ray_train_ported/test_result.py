"""Ray Train's ``v2/tests/test_result.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same tests: ``Result``'s repr shows the metrics and the checkpoint as Ray prints it;
``get_best_checkpoint`` by max and min; a failed run (``WorkerGroupError``) keeps its
best 3 checkpoints by ``metric_a``, and ``Result.from_path`` (a ``str`` or a ``Path``,
with or without a trailing slash, with or without the filesystem) rebuilds them with
their metrics and refuses an unknown metric; ``from_path`` refuses a missing folder
and a folder that is not a run.

Fixture changes: the session's shared Ray instance; Ray's dict-checkpoint helpers
written here; local storage only (the "remote" cases need Ray's S3 mock, ``moto``).
polytrain has no checkpoint-manager snapshot file: a folder without a committed
checkpoint is what ``from_path`` refuses.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs
import pytest

from polytrain import train
from polytrain.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from polytrain.train.errors import WorkerGroupError
from polytrain.train.result import Result
from polytrain.train.torch import TorchTrainer
from tests.integration.ray_train_ported.helpers import dict_checkpoint, load_dict


def build_dummy_trainer(exp_name, storage_path, num_iterations, num_checkpoints):
    def worker_loop(_config):
        for i in range(num_iterations):
            train.report({"metric_a": -100, "metric_b": -100})  # reports between checkpoints
            if train.get_context().get_world_rank() == 0:
                with dict_checkpoint({"iter": i}) as checkpoint:
                    train.report({"metric_a": i, "metric_b": -i}, checkpoint=checkpoint)
            else:
                train.report({"metric_a": i, "metric_b": -i})
        raise RuntimeError()

    return TorchTrainer(
        train_loop_per_worker=worker_loop,
        train_loop_config={"a": 1, "b": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=exp_name,
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=num_checkpoints,
                checkpoint_score_attribute="metric_a",
                checkpoint_score_order="max",
            ),
        ),
    )


def test_result_repr():
    res = Result(
        metrics={"iter": 0, "metric": 1.0},
        checkpoint=Checkpoint("/bucket/path/ckpt0"),
        error=None,
        path="/bucket/path",
    )
    assert "Checkpoint(filesystem=local, path=/bucket/path/ckpt0)" in repr(res)
    assert "metrics={'iter': 0, 'metric': 1.0}" in repr(res)


def test_get_best_checkpoint():
    res = Result(
        metrics={},
        checkpoint=None,
        error=None,
        path="/bucket/path",
        best_checkpoints=[
            (Checkpoint(f"/bucket/path/ckpt{i}"), {"iter": i, "metric": i + 1.0}) for i in range(4)
        ],
    )
    assert res.get_best_checkpoint(metric="metric", mode="max").path == "/bucket/path/ckpt3"
    assert res.get_best_checkpoint(metric="metric", mode="min").path == "/bucket/path/ckpt0"


def _long(*values):
    """The first value runs in CI; the others are long_matrix cases."""
    return [values[0], *(pytest.param(v, marks=pytest.mark.long_matrix) for v in values[1:])]


@pytest.mark.parametrize("path_type", _long("str", "PathLike"))
@pytest.mark.parametrize("pass_storage_filesystem", _long(True, False))
@pytest.mark.parametrize("trailing_slash", _long(False, True))
def test_result_restore(
    ray_start_4_cpus, tmp_path, path_type, pass_storage_filesystem, trailing_slash
):
    num_iterations, num_checkpoints = 5, 3
    exp_name = "test_result_restore_v2"
    trainer = build_dummy_trainer(exp_name, str(tmp_path), num_iterations, num_checkpoints)
    with pytest.raises(WorkerGroupError):
        trainer.fit()

    trial_dir = str(tmp_path / exp_name) + ("/" if trailing_slash else "")
    filesystem = pyarrow.fs.LocalFileSystem() if pass_storage_filesystem else None
    result = Result.from_path(
        Path(trial_dir) if path_type == "PathLike" else trial_dir, storage_filesystem=filesystem
    )
    assert result.checkpoint
    assert len(result.best_checkpoints) == num_checkpoints
    best_a = result.get_best_checkpoint(metric="metric_a", mode="max")
    assert load_dict(best_a)["iter"] == num_iterations - 1
    best_b = result.get_best_checkpoint(metric="metric_b", mode="max")
    assert load_dict(best_b)["iter"] == num_iterations - num_checkpoints
    with pytest.raises(RuntimeError, match="Invalid metric name.*"):
        result.get_best_checkpoint(metric="invalid_metric", mode="max")


@pytest.mark.parametrize("path_type", ["str", "PathLike"])
def test_result_from_path_validation(tmp_path, path_type):
    def as_arg(path: Path):
        return path if path_type == "PathLike" else str(path)

    with pytest.raises(RuntimeError, match="Experiment folder .* doesn't exist"):
        Result.from_path(as_arg(tmp_path / "nonexistent_experiment"))
    existing = tmp_path / "existing_experiment"
    existing.mkdir()
    with pytest.raises(RuntimeError, match="Failed to restore the Result object"):
        Result.from_path(as_arg(existing))
