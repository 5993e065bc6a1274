"""The checkpoint format: atomic writes, safe and validated loading."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import time

import pytest
import torch

from polytrain.checkpoint.single_file import (
    FORMAT,
    VERSION,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from polytrain.errors import CheckpointError


def _state(value: float = 1.0, size: int = 4) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "framework": "torch",
        "backend": "ddp",
        "world_size": 2,
        "epoch": 1,
        "models": [{"w": torch.full((size,), value)}],
        "optimizers": [None],
    }


def test_round_trip(tmp_path):
    path = save_checkpoint(_state(3.0), tmp_path / "sub" / "c.pt")
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["models"][0]["w"], torch.full((4,), 3.0))
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]  # no temp file left


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"", "Could not read checkpoint"),
        (b"\x00garbage" * 100, "Could not read checkpoint"),
    ],
)
def test_corrupted_files_are_rejected(tmp_path, content, pattern):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path)


def test_truncated_checkpoint_is_rejected(tmp_path):
    path = save_checkpoint(_state(size=100_000), tmp_path / "c.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupted"):
        load_checkpoint(path)


def test_plain_state_dict_is_not_a_polytrain_checkpoint(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(CheckpointError, match="not a polytrain checkpoint.*model.load_state_dict"):
        load_checkpoint(path)


def test_arbitrary_pickles_are_never_unpickled(tmp_path):
    class Evil:
        def __reduce__(self):
            return (exec, ("import os; open('PWNED', 'w').close()",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as handle:
        pickle.dump({"format": FORMAT, "payload": Evil()}, handle)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_missing_file_wrong_framework_and_newer_version(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    path = save_checkpoint(_state(), tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="written by a torch trainer.*tensorflow"):
        load_checkpoint(path, framework="tensorflow")
    newer = {**_state(), "version": VERSION + 1}
    torch.save(newer, tmp_path / "new.pt")
    with pytest.raises(CheckpointError, match="Upgrade polytrain"):
        load_checkpoint(tmp_path / "new.pt")


def test_pruning_keeps_the_newest(tmp_path):
    for epoch in range(5):
        save_checkpoint(_state(), tmp_path / f"checkpoint_epoch_{epoch:06d}.pt")
    prune_checkpoints(tmp_path, 2)
    assert latest_checkpoint(tmp_path).name == "checkpoint_epoch_000004.pt"
    assert len(list(tmp_path.iterdir())) == 2


# Built in the parent: a forked child must not run torch kernels (OpenMP is not fork-safe).
_STATES = [{**_state(float(k), size=2_000_000), "epoch": k} for k in range(3)]


def _save_forever(path: str, ready) -> None:
    i = 0
    while True:
        state = _STATES[i % 3]
        save_checkpoint({**state, "epoch": i}, path)
        i += 1
        ready.set()


def test_kill_during_save_always_leaves_the_previous_checkpoint_loadable(tmp_path):
    """A process SIGKILLed at a random moment of save(), 20 times: the file always loads."""
    path = tmp_path / "ckpt.pt"
    context = multiprocessing.get_context("fork")  # torch is already imported: fork is fast
    rng = random.Random(0)
    epochs = []
    for _ in range(20):
        ready = context.Event()
        proc = context.Process(target=_save_forever, args=(str(path), ready))
        proc.start()
        assert ready.wait(60)  # at least one complete save in this round
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        state = load_checkpoint(path)
        assert torch.all(state["models"][0]["w"] == float(state["epoch"] % 3))
        epochs.append(state["epoch"])
    assert max(epochs) > 0  # some kills landed after several saves, i.e. mid-write of a later one
