"""Storage faults (issue 28, item 3): a failed checkpoint write, and a damaged newest checkpoint.

A real disk runs full: a small tmpfs is the ``checkpoint_dir`` (root only; under
``CI=true`` as root the test must run). The write that no longer fits fails on
the workers; the previous checkpoint stays committed and loads, the error names
the path and ENOSPC, training continues until ``max_checkpoint_failures``
writes in a row failed (a failed write is tried again at the next due
point). A resume skips an uncommitted and a truncated newest
checkpoint, naming each, and continues from the newest complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer
from polytrain.checkpoint import layout
from polytrain.checkpoint.storage import Storage
from polytrain.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

WIDTH = 128  # two 128x256 weights: 128 KiB each, one per rank


def _model(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )


def _data(config):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, WIDTH, generator=g)
    return DataLoader(TensorDataset(x, x.clone()), batch_size=config["batch_size"])


def _trainer(folder, **checkpoint) -> TorchTrainer:
    return TorchTrainer(
        model_creator=_model,
        data_creator=_data,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.01),
        loss_creator=torch.nn.MSELoss,
        config={"batch_size": 16},
        num_workers=2,
        failure_config={"max_retries": 0, "max_checkpoint_failures": 2},
        checkpoint_config={"checkpoint_dir": str(folder), "every_n_steps": 2, **checkpoint},
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 384 KiB tmpfs: one checkpoint of the model (~260 KiB) fits, a second does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    must_run = os.environ.get("CI") == "true" and os.geteuid() == 0
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        if must_run:
            pytest.fail(f"CI=true as root, yet mounting a tmpfs failed: {done.stderr}")
        pytest.skip(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk, tmp_path, no_leftover_actors):
    trainer = _trainer(small_disk)
    try:
        first = trainer.train(num_steps=2)
        kept = first["checkpoint_path"]
        assert "checkpoint_error" not in first
        expected = trainer.state_dict()
        second = trainer.train(num_steps=2)  # the disk is full: warned, training goes on
        assert "ENOSPC" in second["checkpoint_error"]
        assert "checkpoint_000000.00000004" in second["checkpoint_error"]
        assert "checkpoint_path" not in second
        with pytest.raises(CheckpointError, match="ENOSPC") as info:
            trainer.train(num_steps=2)  # the second failed write in a row stops training
        assert "checkpoint_000000.00000006" in str(info.value)
        assert kept in str(info.value)  # names the checkpoint to resume from
    finally:
        trainer.shutdown()
    # Nothing half-written is left: only the committed first checkpoint.
    assert Storage(str(small_disk)).listdir() == [os.path.basename(kept)]
    copy = tmp_path / "copy"
    shutil.copytree(small_disk, copy)
    loader = _trainer(tmp_path / "other")
    try:
        loader.load(copy / os.path.basename(kept))
        got = loader.state_dict()
    finally:
        loader.shutdown()
    assert (got["epoch"], got["epoch_step"]) == (0, 2)
    for key, value in expected["models"][0].items():
        assert torch.equal(value, got["models"][0][key]), key


def test_resume_skips_an_uncommitted_and_a_truncated_newest_checkpoint(
    tmp_path, caplog, no_leftover_actors
):
    folder = tmp_path / "run"
    trainer = _trainer(folder, num_to_keep=5)
    try:
        trainer.train(num_steps=2)
        trainer.train(num_steps=2)
        expected = trainer.state_dict()  # at batch 4
        trainer.train(num_steps=2)
    finally:
        trainer.shutdown()
    root = Storage(str(folder))
    names = [name for _, name in layout.list_checkpoint_dirs(root)]
    assert names[-2:] == ["checkpoint_000000.00000004", "checkpoint_000000.00000006"]
    truncated = folder / names[-1] / "rank_00000.bin"
    truncated.write_bytes(truncated.read_bytes()[:100])  # committed, but damaged
    uncommitted = folder / "checkpoint_000000.00000008"
    shutil.copytree(folder / names[-2], uncommitted)
    (uncommitted / layout.MARKER).unlink()  # an interrupted save
    caplog.set_level(logging.WARNING, logger="polytrain")
    resumed = _trainer(folder, resume=True)
    try:
        assert (resumed.epoch, resumed.position.epoch_step) == (0, 4)
        got = resumed.state_dict()
    finally:
        resumed.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(warnings) == 2
    assert "checkpoint_000000.00000008" in warnings[0] and "COMMITTED" in warnings[0]
    assert "checkpoint_000000.00000006" in warnings[1] and "truncated" in warnings[1]
    for key, value in expected["models"][0].items():
        assert torch.equal(value, got["models"][0][key]), key
