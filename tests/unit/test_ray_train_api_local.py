"""Ray Train's API in local mode (``num_workers=0``: the loop in this process, no Ray).

Each test runs a real ``fit()`` of a small loop and checks one of Ray Train's names:
the error kinds ``fit()`` raises, collectives, ``get_all_reported_checkpoints``,
``UserCallback``, ``checkpoint_dir_name`` and the upload modes, validation, the return
value, ``TorchCheckpoint``, custom filesystems, and the refusals that name what to do.
"""

from __future__ import annotations

import os
import pickle
import tempfile

import pyarrow.fs
import pytest
import torch

from polytrain import train
from polytrain.errors import ConfigError, WorkerError
from polytrain.train import (
    Checkpoint,
    CheckpointConfig,
    CheckpointUploadMode,
    DataParallelTrainer,
    ReportedCheckpointStatus,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    UserCallback,
    ValidationConfig,
    ValidationTaskConfig,
    WorkerGroupError,
)
from polytrain.train.collective import barrier, broadcast_from_rank_zero
from polytrain.train.torch import TorchCheckpoint, TorchTrainer

LOCAL = ScalingConfig(num_workers=0)


def _fit(loop, tmp_path, trainer_cls=DataParallelTrainer, **kwargs):
    run = kwargs.pop("run_config", {})
    return trainer_cls(
        loop,
        scaling_config=LOCAL,
        run_config=RunConfig(storage_path=str(tmp_path), name="run", **run),
        **kwargs,
    ).fit()


def _checkpoint(value) -> Checkpoint:
    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, "value.pkl"), "wb") as handle:
        pickle.dump(value, handle)
    return Checkpoint.from_directory(directory)


def test_a_loop_error_is_a_worker_group_error_and_still_the_users_class(tmp_path):
    def loop():
        raise KeyError("no such column")

    with pytest.raises(TrainingFailedError) as info:
        _fit(loop, tmp_path)
    error = info.value
    assert isinstance(error, WorkerGroupError)
    assert isinstance(error, WorkerError) and error.rank == 0
    assert isinstance(error, KeyError)  # except KeyError in the user's code still works
    assert "no such column" in error.remote_traceback
    assert isinstance(error.worker_failures[0], KeyError)


def test_collectives_reports_and_the_return_value(tmp_path):
    seen = []

    class Recorder(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            seen.append((metrics, checkpoint.path if checkpoint else None))

    def loop():
        barrier()
        assert broadcast_from_rank_zero({"a": 1}) == {"a": 1}
        for i in range(3):
            train.report({"i": i}, checkpoint=_checkpoint(i), checkpoint_dir_name=f"epoch={i}")
        kept = train.get_all_reported_checkpoints()
        assert [c.metrics["i"] for c in kept] == [1, 2]
        assert {c.status for c in kept} == {ReportedCheckpointStatus.COMMITTED}
        return {"done": True}

    result = _fit(
        loop,
        tmp_path,
        run_config={"callbacks": [Recorder()], "checkpoint_config": {"num_to_keep": 2}},
    )
    assert result.return_value == {"done": True}
    assert sorted(os.listdir(tmp_path / "run")) == ["epoch=1", "epoch=2"]
    assert [m for m, _ in seen] == [[{"i": 0}], [{"i": 1}], [{"i": 2}]]
    assert seen[-1][1] == str(tmp_path / "run" / "epoch=2")
    assert result.checkpoint.path == str(tmp_path / "run" / "epoch=2")


def test_async_upload_keeps_order_and_deletes_the_source(tmp_path):
    sources = []

    def loop():
        for i in range(3):
            checkpoint = _checkpoint(i)
            sources.append(checkpoint.path)
            mode = CheckpointUploadMode.ASYNC if i != 1 else CheckpointUploadMode.SYNC
            train.report({"i": i}, checkpoint=checkpoint, checkpoint_upload_mode=mode)

    result = _fit(loop, tmp_path)
    assert [m["i"] for m in result.metrics_history] == [0, 1, 2]
    assert [os.path.exists(s) for s in sources] == [False, True, False]  # ASYNC deletes
    with result.checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "value.pkl"), "rb") as handle:
            assert pickle.load(handle) == 2


def test_no_upload_registers_a_directory_written_into_the_run(tmp_path):
    def loop():
        target = os.path.join(train.get_context().get_storage().experiment_fs_path, "mine")
        os.makedirs(target)
        open(os.path.join(target, "w.txt"), "w").close()
        train.report(
            {"x": 1},
            checkpoint=Checkpoint.from_directory(target),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
        with pytest.raises(ConfigError, match="not a directory directly below"):
            train.report(
                {"x": 2},
                checkpoint=_checkpoint(0),
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )

    result = _fit(loop, tmp_path)
    assert result.checkpoint.path == str(tmp_path / "run" / "mine")


def test_validation_runs_on_committed_checkpoints_and_ranks_them(tmp_path):
    def evaluate(checkpoint, scale=1):
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, "value.pkl"), "rb") as handle:
                value = pickle.load(handle)
        if value == 2:
            raise RuntimeError("evaluation failed")
        return {"val": value * scale}

    def loop():
        for i in range(3):
            validation = ValidationTaskConfig(fn_kwargs={"scale": 10}) if i == 0 else True
            train.report({"i": i}, checkpoint=_checkpoint(i), validation=validation)

    result = _fit(
        loop,
        tmp_path,
        validation_config=ValidationConfig(evaluate),
        run_config={"checkpoint_config": CheckpointConfig(checkpoint_score_attribute="val")},
    )
    # 2's validation failed: no "val", ranked below the validated ones; 0 scored 0 * 10.
    assert [m.get("val") for _, m in result.best_checkpoints] == [None, 0, 1]


def test_validation_needs_a_checkpoint_and_a_validation_config(tmp_path):
    def loop():
        with pytest.raises(ConfigError, match="requires a checkpoint"):
            train.report({}, validation=True)
        with pytest.raises(ConfigError, match="validation_config"):
            train.report({}, checkpoint=_checkpoint(0), validation=True)

    _fit(loop, tmp_path)


def test_torch_checkpoint_comes_back_as_its_class(tmp_path):
    def loop():
        model = train.torch.prepare_model(torch.nn.Linear(2, 1))
        train.report({}, checkpoint=TorchCheckpoint.from_model(model))

    result = _fit(loop, tmp_path, trainer_cls=TorchTrainer)
    assert isinstance(result.checkpoint, TorchCheckpoint)
    loaded = result.checkpoint.get_model(torch.nn.Linear(2, 1))
    assert isinstance(loaded, torch.nn.Linear)


def test_a_custom_pyarrow_filesystem_holds_the_run(tmp_path):
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    (tmp_path / "root").mkdir()
    fs = pyarrow.fs.PyFileSystem(
        pyarrow.fs.FSSpecHandler(DirFileSystem(path=str(tmp_path / "root"), fs=LocalFileSystem()))
    )

    def loop():
        train.report({"x": 1}, checkpoint=_checkpoint(1))

    result = DataParallelTrainer(
        loop,
        scaling_config=LOCAL,
        run_config=RunConfig(storage_path="bucket/runs", storage_filesystem=fs, name="run"),
    ).fit()
    assert result.path == "bucket/runs/run"
    assert result.filesystem is fs
    assert result.checkpoint.path == "bucket/runs/run/checkpoint_000000"
    assert (tmp_path / "root" / "bucket" / "runs" / "run" / "checkpoint_000000").is_dir()


def test_removed_and_unsupported_options_name_what_to_use(tmp_path):
    with pytest.raises(ConfigError, match="UserCallback"):
        RunConfig(callbacks=[object()])
    with pytest.raises(ConfigError, match="env_vars"):
        RunConfig(worker_runtime_env={"pip": ["x"]})
    with pytest.raises(ConfigError, match="custom resource"):
        ScalingConfig(label_selector={"zone": "a"})
    with pytest.raises(DeprecationWarning, match="train_loop_config"):
        DataParallelTrainer(lambda: None, metadata={"a": 1})
    with pytest.raises(ConfigError, match="backend='fsdp'"):

        def loop():
            train.torch.prepare_model(torch.nn.Linear(1, 1), parallel_strategy="fsdp")

        _fit(loop, tmp_path, trainer_cls=TorchTrainer)
    scaling = ScalingConfig(num_workers=(1, 3), accelerator_type="H100")
    assert (scaling.min_workers, scaling.num_workers) == (1, 3)
    assert scaling.resources_per_worker == {"accelerator_type:H100": 0.001}
