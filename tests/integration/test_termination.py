"""The driver's termination signal (issue 28, item 2): SIGTERM mid-epoch loses no step.

A driver process (``termination_driver.py``) trains a model with dropout, with mid-epoch
checkpoints in a ``checkpoint_dir``; SIGTERM to it while an epoch runs makes the
workers checkpoint at the next boundary and the process exit with status 143. The
same command (``resume=True``) continues there: the batches both runs trained are
exactly those of an uninterrupted run (none lost, none repeated), and the final
weights are equal bit for bit (random states restored). ``polytrain train`` under
SIGTERM exits 143 and the same command with ``--resume`` finishes the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from polytrain.checkpoint import layout
from polytrain.errors import TerminatedError

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

EPOCHS = 2


def _driver(address: str, tmp_path: Path, name: str) -> subprocess.Popen:
    script = Path(__file__).with_name("termination_driver.py")
    args = [tmp_path / name, EPOCHS, tmp_path / f"{name}.pt", tmp_path / f"{name}.log"]
    return subprocess.Popen(
        [sys.executable, str(script), address, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _committed(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"checkpoint_*/{layout.MARKER}")) if folder.exists() else []


def test_sigterm_checkpoints_at_the_next_boundary_and_resume_loses_no_step(
    ray_start_4_cpus, tmp_path
):
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    clean = _driver(address, tmp_path, "clean")
    out, err = clean.communicate(timeout=600)
    assert clean.returncode == 0, err[-3000:]

    run = _driver(address, tmp_path, "run")
    while not _committed(tmp_path / "run") and run.poll() is None:
        time.sleep(0.05)  # the first mid-epoch checkpoint: the run is inside epoch 0
    assert run.poll() is None, "the run ended before the signal"
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=600)
    assert run.returncode == TerminatedError.exit_code == 143, err[-3000:]
    assert "SIGTERM received: the workers checkpoint at epoch" in err  # the decision, logged
    assert "Training stopped on SIGTERM" in err and "no step lost" in err
    line = out.splitlines()[-1].split()
    assert line[:2] == ["preempted", "at"], out
    stop, path = (int(line[2]), int(line[3])), line[4]
    assert stop < (EPOCHS, 0)  # it stopped early, not at the end
    assert (Path(path) / layout.MARKER).exists()
    assert not (tmp_path / "run.pt").exists()

    resumed = _driver(address, tmp_path, "run")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert out.splitlines()[0] == f"start {stop[0]} {stop[1]}"  # where the stop checkpointed

    # Rank 0 trained every batch of the clean run exactly once across both runs.
    clean_batches = (tmp_path / "clean.log").read_text().splitlines()
    assert (tmp_path / "run.log").read_text().splitlines() == clean_batches
    expected = torch.load(tmp_path / "clean.pt", weights_only=True)
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    for key, value in expected["models"][0].items():
        assert torch.equal(value, got["models"][0][key]), key


def test_polytrain_train_exits_143_on_sigterm_and_resume_finishes(ray_start_4_cpus, tmp_path):
    """`polytrain train` under SIGTERM: status 143 after the checkpoint; `--resume` finishes the run."""
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    command = [
        sys.executable, "-m", "polytrain", "train", "-c", "examples/configs/ddp.yaml",
        "epochs=4", "checkpoint.every_n_steps=2", "checkpoint.num_to_keep=100",
        "--out", str(tmp_path), "--address", address, "--no-progress",
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    run = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    while not _committed(tmp_path / "checkpoints") and run.poll() is None:
        time.sleep(0.05)
    assert run.poll() is None, "the run ended before the signal"
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 143, err[-3000:]
    assert "Training stopped on SIGTERM" in err and "no step lost" in err
    assert not (tmp_path / "final.pt").exists()
    resumed = subprocess.run(
        [*command, "--resume"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(tmp_path / "final.pt", weights_only=True)["epoch"] == 4
