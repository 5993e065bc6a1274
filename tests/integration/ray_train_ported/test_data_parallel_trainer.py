"""Ray Train's ``v2/tests/test_data_parallel_trainer.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same tests: a custom ``BackendConfig``'s hooks run; ``Result`` has the run's path and a
pyarrow filesystem; a trainer with no options fits; ``train_loop_config`` reaches the
loop; checkpoints from rank 0 only and from several ranks (their files merged);
``get_all_reported_checkpoints`` answers by the reports made; a worker's error is a
``TrainingFailedError`` (a ``WorkerGroupError``); ``RAY_CHDIR_TO_TRIAL_DIR`` puts the
workers in the run's working directory; ``UserCallback`` gets every worker's metrics
and the failure; Ctrl-C (SIGINT) ends a running ``fit()``.

Fixture changes: the session's shared Ray instance; Ray's ``create_dict_checkpoint``
test helper is :func:`dict_checkpoint` here. ``test_sigint_abort`` runs its driver as
a subprocess that joins the session's Ray instance and signals readiness through a
file (Ray's version patches its controller actor and waits on a signal actor).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pyarrow.fs
import pytest

import polytrain.train
from polytrain.train import (
    BackendConfig,
    Checkpoint,
    DataParallelTrainer,
    RunConfig,
    ScalingConfig,
    UserCallback,
)
from polytrain.train.backend import Backend
from polytrain.train.constants import RAY_CHDIR_TO_TRIAL_DIR, _get_ray_train_session_dir
from polytrain.train.errors import TrainingFailedError, WorkerGroupError
from polytrain.train.result import Result
from tests.integration.ray_train_ported.helpers import dict_checkpoint

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_backend_setup(tmp_path):
    class ValidationBackend(Backend):
        def on_start(self, worker_group, backend_config):
            assert len(worker_group) == 2
            tmp_path.joinpath("on_start").touch()

        def on_training_start(self, worker_group, backend_config):
            tmp_path.joinpath("on_training_start").touch()

        def on_shutdown(self, worker_group, backend_config):
            tmp_path.joinpath("on_shutdown").touch()

    class ValidationBackendConfig(BackendConfig):
        @property
        def backend_cls(self):
            return ValidationBackend

    DataParallelTrainer(
        lambda: None,
        backend_config=ValidationBackendConfig(),
        scaling_config=ScalingConfig(num_workers=2),
    ).fit()
    for hook in ("on_start", "on_training_start", "on_shutdown"):
        assert tmp_path.joinpath(hook).exists(), hook


def test_result_output(tmp_path):
    result = DataParallelTrainer(
        lambda: None,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="test", storage_path=str(tmp_path)),
    ).fit()
    assert isinstance(result, Result)
    assert result.path == str(tmp_path / "test")
    assert isinstance(result.filesystem, pyarrow.fs.FileSystem)


def test_no_optional_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the default storage path is below ~
    DataParallelTrainer(lambda: "not used").fit()


def test_train_loop_config(tmp_path):
    def train_fn(config):
        with dict_checkpoint({}) as checkpoint:
            polytrain.train.report(metrics=config, checkpoint=checkpoint)

    result = DataParallelTrainer(
        train_fn,
        train_loop_config={"x": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    assert result.metrics == {"x": 1}


def test_report_checkpoint_rank0(tmp_path):
    def train_fn():
        rank = polytrain.train.get_context().get_world_rank()
        if rank == 0:
            with dict_checkpoint({}) as checkpoint:
                polytrain.train.report(metrics={"rank": rank}, checkpoint=checkpoint)
        else:
            polytrain.train.report(metrics={"rank": rank}, checkpoint=None)

    result = DataParallelTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    assert result.metrics == {"rank": 0}
    assert result.checkpoint


def test_report_checkpoint_multirank(tmp_path):
    ranks_to_report = [1, 3]

    def train_fn():
        rank = polytrain.train.get_context().get_world_rank()
        if rank in ranks_to_report:
            with tempfile.TemporaryDirectory() as directory:
                Path(directory, str(rank)).touch()
                polytrain.train.report(
                    {"rank": rank}, checkpoint=Checkpoint.from_directory(directory)
                )
        else:
            polytrain.train.report({"rank": rank}, checkpoint=None)

    result = DataParallelTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    assert result.checkpoint
    result.checkpoint.to_directory(tmp_path / "validate")
    for rank in ranks_to_report:
        assert tmp_path.joinpath("validate", str(rank)).exists()


def test_report_get_all_reported_checkpoints(tmp_path):
    def train_fn():
        if polytrain.train.get_context().get_world_rank() == 0:
            polytrain.train.report(metrics={}, checkpoint=None)
            with dict_checkpoint({}) as checkpoint:
                polytrain.train.report(metrics={}, checkpoint=checkpoint)
            assert len(polytrain.train.get_all_reported_checkpoints()) == 1
            with dict_checkpoint({}) as checkpoint:
                polytrain.train.report(metrics={}, checkpoint=checkpoint)
        else:
            for _ in range(3):
                polytrain.train.report(metrics={}, checkpoint=None)
            assert len(polytrain.train.get_all_reported_checkpoints()) == 2

    DataParallelTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()


def test_error(tmp_path):
    def error_on_rank_0():
        if polytrain.train.get_context().get_world_rank() == 0:
            raise ValueError("error")

    trainer = DataParallelTrainer(
        error_on_rank_0,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="test", storage_path=str(tmp_path)),
    )
    with pytest.raises(TrainingFailedError) as info:
        trainer.fit()
    assert isinstance(info.value, WorkerGroupError)
    assert isinstance(info.value.worker_failures[0], ValueError)


@pytest.mark.parametrize("env_disabled", [True, False])
def test_setup_working_directory(tmp_path, monkeypatch, env_disabled):
    monkeypatch.setenv(RAY_CHDIR_TO_TRIAL_DIR, str(int(not env_disabled)))
    reference = Path(_get_ray_train_session_dir(), "test").resolve().as_posix()

    def check_working_directory():
        if env_disabled:
            assert os.getcwd() != reference
        else:
            assert os.getcwd() == reference

    DataParallelTrainer(
        check_working_directory,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="test", storage_path=str(tmp_path)),
    ).fit()


def test_user_callback(tmp_path):
    num_workers = 2
    seen = {}

    class MyUserCallback(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            assert len(metrics) == num_workers
            assert not checkpoint
            seen["report"] = metrics

        def after_exception(self, run_context, worker_exceptions):
            assert len(worker_exceptions) == 1
            assert worker_exceptions.get(0) is not None
            seen["exception"] = worker_exceptions

    def train_fn(config):
        rank = polytrain.train.get_context().get_world_rank()
        polytrain.train.report(metrics={"rank": rank})
        if rank == 0:
            raise ValueError("error")

    trainer = DataParallelTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(storage_path=str(tmp_path), callbacks=[MyUserCallback()]),
    )
    with pytest.raises(WorkerGroupError):  # not the callback's AssertionError
        trainer.fit()
    assert seen["report"] == [{"rank": 0}, {"rank": 1}]
    assert set(seen["exception"]) == {0}


SIGINT_DRIVER = """
import os, sys, time
import ray
from polytrain.train import DataParallelTrainer, RunConfig, ScalingConfig

ray.init(address=sys.argv[1])
marker = sys.argv[2]

def train_fn():
    open(marker, "w").close()
    while True:
        time.sleep(0.1)

DataParallelTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(storage_path=sys.argv[3])).fit()
"""


def test_sigint_abort(ray_start_4_cpus, tmp_path):
    marker = tmp_path / "training"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RAY_ADDRESS", None)
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SIGINT_DRIVER), address, str(marker),
         str(tmp_path / "runs")],
        env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None and time.monotonic() < deadline, "training never began"
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGINT)
        assert process.wait(timeout=60) != 0  # the run stopped: fit() raised KeyboardInterrupt
    finally:
        if process.poll() is None:
            process.kill()
