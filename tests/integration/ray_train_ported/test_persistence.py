"""Ray Train's ``v2/tests/test_persistence.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same test: a 3-worker run that fails at iterations 2 and 4 (``max_failures=2``) and
is started again with the same ``RunConfig``, checkpointing every iteration under
``checkpoint_dir_name=f"checkpoint_epoch={i}"`` from every rank but rank 0 (each
rank adds its own shard file), with ``get_all_reported_checkpoints`` counted at every
start and failure and a ``collective.barrier`` per iteration; then the storage must
hold exactly the kept checkpoints (all, or the best one by score), each with the
shared file and one shard per checkpointing rank, and ``Result``'s paths must lie in
the run's storage. Storage kinds: a local ("NFS") path and a custom pyarrow
filesystem (fsspec's ``DirFileSystem`` wrapped in ``PyFileSystem``).

Fixture changes: the session's shared Ray instance; Ray's health-check interval
(Ray-internal) dropped; the storage is inspected in place (Ray downloads it with an
internal helper). The "cloud" case needs Ray's S3 mock (``moto``), not installed here:
skipped.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs
import pytest

import polytrain.train
import polytrain.train.collective
from polytrain.train import (
    Checkpoint,
    CheckpointConfig,
    DataParallelTrainer,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

NUM_ITERATIONS = 6
NUM_WORKERS = 3
SCORE_KEY = "score"
SHARD = "checkpoint_shard-rank={}.pkl"


@contextmanager
def nothing(*args, **kwargs):
    yield


def train_fn(config):
    start = 0
    checkpoint = polytrain.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, "checkpoint.pkl"), "rb") as handle:
                start = pickle.load(handle)["iter"] + 1
    got = len(polytrain.train.get_all_reported_checkpoints())
    assert got == min(start, config["num_to_keep"]), got

    for i in range(start, config["num_iterations"]):
        time.sleep(config["time_per_iter"])
        metrics = {"iter": i, SCORE_KEY: i}
        rank = polytrain.train.get_context().get_world_rank()
        if rank in config["no_checkpoint_ranks"]:
            polytrain.train.report(
                metrics, checkpoint=None, checkpoint_dir_name=f"checkpoint_epoch={i}"
            )
        else:
            with tempfile.TemporaryDirectory() as directory:
                for name in ("checkpoint.pkl", SHARD.format(rank)):
                    with open(os.path.join(directory, name), "wb") as handle:
                        pickle.dump({"iter": i}, handle)
                polytrain.train.report(
                    metrics,
                    checkpoint=Checkpoint.from_directory(directory),
                    checkpoint_dir_name=f"checkpoint_epoch={i}",
                )
                assert os.path.exists(directory)  # report must not delete the source
        polytrain.train.collective.barrier()
        if i in config["fail_iters"]:
            got = len(polytrain.train.get_all_reported_checkpoints())
            assert got == min(i + 1, config["num_to_keep"]), got
            raise RuntimeError(f"Failing on iter={i}!!")


def _storage(kind: str, tmp_path: Path):
    if kind == "nfs":
        return str(tmp_path / "fake_nfs"), None, tmp_path / "fake_nfs"
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    root = tmp_path / "custom_fs"
    root.mkdir()
    fs = pyarrow.fs.PyFileSystem(
        pyarrow.fs.FSSpecHandler(DirFileSystem(path=str(root), fs=LocalFileSystem()))
    )
    return "mock_bucket", fs, root / "mock_bucket"


def _check_storage(local_root: Path, exp_name: str, checkpoint_config: CheckpointConfig):
    experiments = list(local_root.glob("*"))
    assert [p.name for p in experiments] == [exp_name]
    expected = checkpoint_config.num_to_keep or NUM_ITERATIONS
    found = sorted(
        int(re.search(r"checkpoint_epoch=(\d+)", p.name).group(1))
        for p in experiments[0].glob("checkpoint_epoch=*")
    )
    assert found == list(range(NUM_ITERATIONS - expected, NUM_ITERATIONS))
    for directory in experiments[0].glob("checkpoint_epoch=*"):
        assert len(list(directory.glob("checkpoint.pkl"))) == 1
        shards = {
            int(re.search(r"rank=(\d+)", p.name).group(1))
            for p in directory.glob("checkpoint_shard-*.pkl")
        }
        assert shards == {1, 2}  # every rank but rank 0


@pytest.mark.parametrize(
    "storage_path_type",
    [
        "nfs",
        pytest.param("cloud", marks=pytest.mark.skip(reason="needs moto (Ray's S3 mock)")),
        pytest.param("custom_fs", marks=pytest.mark.long_matrix),
    ],
)
@pytest.mark.parametrize(
    "checkpoint_config",
    [
        CheckpointConfig(),
        pytest.param(
            CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute=SCORE_KEY, checkpoint_score_order="max"
            ),
            marks=pytest.mark.long_matrix,
        ),
    ],
)
def test_trainer(tmp_path, storage_path_type, checkpoint_config):
    exp_name = f"trainer_persistence_test-{uuid.uuid4().hex}"
    storage_path, storage_filesystem, local_root = _storage(storage_path_type, tmp_path)
    run_config = RunConfig(
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        name=exp_name,
        checkpoint_config=checkpoint_config,
        failure_config=FailureConfig(max_failures=2),
    )
    loop_config = {
        "num_iterations": NUM_ITERATIONS,
        "fail_iters": [2, 4],
        "no_checkpoint_ranks": [0],
        "time_per_iter": 0.2,
        "num_to_keep": checkpoint_config.num_to_keep or float("inf"),
    }

    def trainer():
        return DataParallelTrainer(
            train_fn,
            train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=NUM_WORKERS),
            run_config=run_config,
        )

    trainer().fit()
    result = trainer().fit()  # started again on the finished run: nothing left to do

    assert result.path.startswith(storage_path)
    assert result.best_checkpoints
    for checkpoint, _ in result.best_checkpoints:
        assert checkpoint.path.startswith(result.path)
    _check_storage(local_root, exp_name, checkpoint_config)
