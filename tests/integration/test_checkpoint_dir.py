"""Checkpoint directories written by the workers, on real Ray workers and real process groups.

The resharding matrix: a checkpoint saved under each backend at N=2 workers, each
rank writing only what it holds, loads under other backends at 1, 2 and 4
workers with identical weights and optimizer state (compared through the
consolidated ``state_dict()`` of both trainers). Every backend is a saver once
and a loader at least once; world sizes 1, N and 2N all appear. Sharded savers
must split the bytes between their ranks (no rank writes the whole state).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.registry import get_spec
from polytrain.checkpoint import layout
from polytrain.checkpoint.directory import SaveRequest
from polytrain.checkpoint.storage import Storage
from polytrain.errors import CheckpointError
from polytrain.trainer_api.checkpointing import worker_writer as checkpoint_worker
from polytrain.trainer_api.torch.checkpoint import load_operator, save_operator

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

FEATURES, HIDDEN, CLASSES = 16, 33, 5  # odd sizes: shards cut through parameters


def model_creator(config):
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def data_creator(config):
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((256, FEATURES)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, CLASSES, 256))
    return DataLoader(TensorDataset(x, y), batch_size=config["batch_size"])


def optimizer_creator(model, config):
    """Adam with two param groups (per-group lr): state keys and groups must both survive."""
    first, _, last = model
    return torch.optim.Adam(
        [{"params": first.parameters(), "lr": 2 * config["lr"]}, {"params": last.parameters()}],
        lr=config["lr"],
    )


def scheduler_creator(optimizer, config):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def make_trainer(backend: str, num_workers: int) -> TorchTrainer:
    name, _, option = backend.partition("-")
    config = None
    if name == "fairscale":
        config = {"mode": option}
    elif name == "deepspeed":
        config = {"stage": int(option)}
    elif name == "fsdp" and option:
        config = {"version": int(option)}  # "fsdp" alone: the default, FSDP2
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        scheduler_creator=scheduler_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"lr": 0.01, "batch_size": 32},
        num_workers=num_workers,
        backend=name,
        backend_config=config,
    )


def _installed(backend: str) -> bool:
    return get_spec(backend.partition("-")[0]).installed


def assert_same_state(expected: dict, got: dict) -> None:
    """Identical weights; the same optimizer state (every tensor, every group option)."""
    for model_a, model_b in zip(expected["models"], got["models"], strict=True):
        assert model_a.keys() == model_b.keys()
        for key, value in model_a.items():
            assert torch.equal(value, model_b[key]), key
    for opt_a, opt_b in zip(expected["optimizers"], got["optimizers"], strict=True):
        assert opt_a["param_groups"] == opt_b["param_groups"]
        assert opt_a["state"].keys() == opt_b["state"].keys()
        for index, entry in opt_a["state"].items():
            assert entry.keys() == opt_b["state"][index].keys()
            for key, value in entry.items():
                assert torch.equal(value, opt_b["state"][index][key]), (index, key)
    assert expected["schedulers"] == got["schedulers"]


def save_directory(trainer: TorchTrainer, url: str, asynchronous: bool = False) -> list[dict]:
    request = SaveRequest(
        url=url,
        header={"framework": "torch", "backend": trainer.backend_name, "world_size": 2, "epoch": 1},
        asynchronous=asynchronous,
    )
    return trainer.apply_all_operators(functools.partial(save_operator, request=request))


SHARDED = (
    "fairscale-oss",
    "fairscale-sddp",
    "fsdp",
    "fsdp-1",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
)

# saver (at 2 workers) -> [(loader, its workers)]; "fsdp" is FSDP2 (fully_shard), "fsdp-1" FSDP1.
# FSDP2 at 4 workers holds no row of the 5-row layer on rank 3: empty shards load too.
MATRIX = {
    "ddp": [("fsdp", 4), ("fairscale-oss", 1)],
    "horovod": [("deepspeed-1", 2)],
    "fairscale-oss": [("deepspeed-3", 1)],
    "fairscale-sddp": [("fsdp-1", 2), ("horovod", 1)],
    "fsdp": [("ddp", 1), ("fsdp", 1), ("fsdp", 2)],
    "fsdp-1": [("deepspeed-2", 4), ("fairscale-sddp", 2)],
    "deepspeed-1": [("fairscale-sddp", 4)],
    "deepspeed-2": [("ddp", 1)],
    "deepspeed-3": [("fsdp", 1), ("fairscale-oss", 4)],
}


@pytest.mark.parametrize("saver", list(MATRIX))
def test_saved_under_one_backend_loads_under_others_at_other_sizes(saver, tmp_path):
    loaders = MATRIX[saver]
    if not _installed(saver) or not all(_installed(b) for b, _ in loaders):
        pytest.skip("a backend of this row is not installed")
    url = str(tmp_path / "checkpoint_000001")
    source = make_trainer(saver, 2)
    try:
        source.train(num_steps=3)  # Adam state, a scheduler step, weights moved
        expected = source.state_dict()
        written = save_directory(source, url)
    finally:
        source.shutdown()
    manifest = layout.open_checkpoint(url, framework="torch").manifest
    assert manifest["backend"] == saver.partition("-")[0] and manifest["writers"] == 2
    shares = [w["bytes"] for w in written]
    # every rank writes part of the state; a sharded saver never writes it all on one rank
    assert min(shares) > 0
    if saver in SHARDED:
        assert max(shares) < 0.8 * sum(shares), shares
    for loader, num_workers in loaders:
        target = make_trainer(loader, num_workers)
        try:
            loaded = target.apply_all_operators(functools.partial(load_operator, url=url))
            assert {r["epoch"] for r in loaded} == {1}
            assert_same_state(expected, target.state_dict())
        finally:
            target.shutdown()


def test_async_save_commits_in_the_background_and_loads(tmp_path):
    """Asynchronous: the call returns after the snapshot; the marker appears when all ranks wrote."""
    url = str(tmp_path / "checkpoint_000001")
    trainer = make_trainer("fsdp", 2)
    try:
        trainer.train(num_steps=2)
        expected = trainer.state_dict()
        written = save_directory(trainer, url, asynchronous=True)
        assert all(w["pending"] for w in written)
        trainer.train(num_steps=2)  # training goes on; the snapshot is what gets written
        flushed = trainer.apply_all_workers(checkpoint_worker.flush)
        assert [f["error"] for f in flushed] == [None, None]
        assert layout.is_committed(layout.Storage(url))
        trainer.apply_all_operators(functools.partial(load_operator, url=url))
        assert_same_state(expected, trainer.state_dict())
    finally:
        trainer.shutdown()


# ---------------------------------------------------------- through the trainer
class DieOnce(TrainingOperator):
    """Rank 1's process exits at its 3rd step of epoch 1, once (a marker file remembers)."""

    def train_batch(self, batch, batch_info):
        marker = self.config["die_marker"]
        if (
            self.world_rank == 1
            and batch_info["epoch_idx"] == 1
            and batch_info["batch_idx"] == 2
            and not os.path.exists(marker)
        ):
            open(marker, "w").close()
            os._exit(1)
        return super().train_batch(batch, batch_info)


def _trainer(backend: str, num_workers: int, tmp_path, **kwargs) -> TorchTrainer:
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        scheduler_creator=scheduler_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"lr": 0.01, "batch_size": 32, "die_marker": str(tmp_path / "died")},
        num_workers=num_workers,
        backend=backend,
        **kwargs,
    )


def test_epoch_ends_write_directories_that_load_anywhere(tmp_path):
    """checkpoint_dir gets committed directories (the newest num_to_keep); load() reads one."""
    folder = tmp_path / "ckpt"
    trainer = _trainer(
        "fsdp", 2, tmp_path, checkpoint_config={"checkpoint_dir": str(folder), "num_to_keep": 2}
    )
    try:
        paths = [trainer.train()["checkpoint_path"] for _ in range(3)]
        expected = trainer.state_dict()
    finally:
        trainer.shutdown()
    assert paths == [str(folder / f"checkpoint_{e:06d}") for e in (1, 2, 3)]
    assert sorted(os.listdir(folder)) == ["checkpoint_000002", "checkpoint_000003"]
    manifest = layout.open_checkpoint(paths[-1], framework="torch").manifest
    assert (manifest["epoch"], manifest["backend"], manifest["writers"]) == (3, "fsdp", 2)
    other = _trainer("deepspeed", 1, tmp_path, backend_config={"stage": 2})
    try:
        other.load(paths[-1])
        assert other.epoch == 3
        assert_same_state(expected, other.state_dict())
        other.train()  # and training continues from there
    finally:
        other.shutdown()


def test_a_lost_worker_is_replaced_from_the_directory_and_ends_where_a_clean_run_does(tmp_path):
    """No checkpoint_dir: the trainer's own directory; the new workers read it themselves."""
    runs = []
    for operator in (TrainingOperator, DieOnce):
        trainer = _trainer(
            "ddp", 2, tmp_path, training_operator_cls=operator, failure_config={"max_retries": 1}
        )
        try:
            stats = [trainer.train() for _ in range(3)]
            point = trainer.recovery.latest  # a directory's path; no state on the driver
            assert point.state is None and layout.is_committed(Storage(point.path))
            runs.append((stats, trainer.state_dict(), trainer.checkpoint_manager.root().url))
        finally:
            trainer.shutdown()
    (clean, clean_state, _), (faulty, faulty_state, folder) = runs
    assert [s["num_restarts"] for s in faulty] == [0, 1, 1]
    assert all("checkpoint_path" not in s for s in faulty)  # the temporary directory is internal
    assert_same_state(clean_state, faulty_state)  # the re-run epoch started from checkpoint 1
    assert not os.path.exists(folder)  # deleted at shutdown


def test_loading_a_damaged_directory_changes_nothing(tmp_path):
    folder = tmp_path / "ckpt"
    trainer = _trainer("ddp", 2, tmp_path, checkpoint_config={"checkpoint_dir": str(folder)})
    try:
        path = trainer.train()["checkpoint_path"]
        trainer.train()
        before = trainer.state_dict()
        data = (folder / "checkpoint_000001" / "rank_00001.bin").read_bytes()
        (folder / "checkpoint_000001" / "rank_00001.bin").write_bytes(data[:-8])
        with pytest.raises(CheckpointError, match="truncated or corrupted"):
            trainer.load(path)
        (folder / "checkpoint_000001" / layout.MARKER).unlink()
        with pytest.raises(CheckpointError, match="no COMMITTED marker"):
            trainer.load(path)
        assert trainer.epoch == 2
        assert_same_state(before, trainer.state_dict())
        trainer.train()  # still usable
    finally:
        trainer.shutdown()


def test_async_epoch_end_checkpoints_commit_before_shutdown_returns(tmp_path):
    folder = tmp_path / "ckpt"
    trainer = _trainer(
        "deepspeed",
        2,
        tmp_path,
        backend_config={"stage": 3},
        checkpoint_config={"checkpoint_dir": str(folder), "async_save": True},
    )
    try:
        paths = [trainer.train()["checkpoint_path"] for _ in range(2)]
        expected = trainer.state_dict()
    finally:
        trainer.shutdown()
    assert all(layout.is_committed(Storage(p)) for p in paths)
    restored = _trainer("fairscale", 2, tmp_path, backend_config={"mode": "sddp"})
    try:
        restored.load(paths[-1])
        assert_same_state(expected, restored.state_dict())
    finally:
        restored.shutdown()


# ------------------------------------------------------- mid-epoch checkpoints
class LogAndDieMidEpoch(TrainingOperator):
    """Rank 0 logs every batch it trains; rank 1's process exits at batch 6 of epoch 1, once."""

    def train_batch(self, batch, batch_info):
        epoch, index = batch_info["epoch_idx"], batch_info["batch_idx"]
        marker = self.config["die_marker"]
        if self.config.get("die") and self.world_rank == 1 and (epoch, index) == (1, 6):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
        if self.world_rank == 0:
            with open(self.config["batch_log"], "a") as log:
                log.write(f"{epoch} {index}\n")
        return super().train_batch(batch, batch_info)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_worker_lost_mid_epoch_resumes_at_the_next_batch_and_ends_like_a_clean_run(
    backend, tmp_path
):
    """every_n_steps=3: a restart loses at most 3 steps and ends with the clean run's state."""
    runs = []
    for die in (False, True):
        log = tmp_path / f"batches-{die}.txt"
        trainer = TorchTrainer(
            model_creator=model_creator,
            data_creator=data_creator,
            optimizer_creator=optimizer_creator,
            scheduler_creator=scheduler_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            training_operator_cls=LogAndDieMidEpoch,
            config={"lr": 0.01, "batch_size": 32, "die": die, "batch_log": str(log),
                    "die_marker": str(tmp_path / "died")},
            num_workers=2,
            backend=backend,
            failure_config={"max_retries": 1},
            checkpoint_config={"checkpoint_dir": str(tmp_path / f"ckpt-{die}"), "every_n_steps": 3,
                               "num_to_keep": 20},
        )  # fmt: skip
        try:
            stats = [trainer.train() for _ in range(3)]
            runs.append((stats, trainer.state_dict(), log.read_text().split("\n")))
        finally:
            trainer.shutdown()
    (clean, clean_state, clean_log), (faulty, faulty_state, faulty_log) = runs
    assert [s["num_restarts"] for s in faulty] == [0, 1, 1]
    assert [s["num_steps"] for s in faulty] == [s["num_steps"] for s in clean] == [8, 8, 8]
    # Epoch 1 resumed from its checkpoint after batch 5 (6 batches in): batch 6 again, not 0.
    epoch_1 = [line for line in faulty_log if line.startswith("1 ")]
    assert epoch_1[: epoch_1.index("1 6") + 1] == [f"1 {i}" for i in range(7)]
    assert epoch_1[epoch_1.index("1 6") + 1 :].count("1 0") == 0
    lost = len(epoch_1) - 8
    assert 0 <= lost <= 3, epoch_1
    names = sorted(os.listdir(tmp_path / "ckpt-True"))
    assert "checkpoint_000001.00000006" in names and "checkpoint_000002" in names
    for key, value in clean_state["models"][0].items():
        assert torch.allclose(value, faulty_state["models"][0][key], rtol=0, atol=1e-6), key


# ------------------------------------------------------------- driver crash
def _driver(address: str, folder, epochs: int, out) -> subprocess.Popen:
    script = Path(__file__).with_name("resume_driver.py")
    return subprocess.Popen(
        [sys.executable, str(script), address, str(folder), str(epochs), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_killed_driver_resumes_from_the_newest_checkpoint(ray_start_4_cpus, tmp_path):
    """SIGKILL the driver mid-run; the same command with resume=True ends where a clean run ends."""
    address = ray_start_4_cpus.get_runtime_context().gcs_address
    epochs = 5
    clean = _driver(address, tmp_path / "clean", epochs, tmp_path / "clean.pt")
    assert clean.wait(timeout=600) == 0
    crashed = _driver(address, tmp_path / "run", epochs, tmp_path / "run.pt")
    second = tmp_path / "run" / "checkpoint_000002" / layout.MARKER
    deadline = time.monotonic() + 600
    while not second.exists() and crashed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert crashed.poll() is None, "the run ended before it could be killed"
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    assert not (tmp_path / "run.pt").exists()
    resumed = _driver(address, tmp_path / "run", epochs, tmp_path / "run.pt")
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0
    start = int(output.splitlines()[0].split()[-1])
    assert 2 <= start < epochs  # it continued from a checkpoint, not from scratch
    expected = torch.load(tmp_path / "clean.pt", weights_only=True)
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    assert got["epoch"] == expected["epoch"] == epochs
    for key, value in expected["models"][0].items():
        assert torch.allclose(value, got["models"][0][key], rtol=0, atol=1e-6), key
    assert_same_state(expected, got)


# -------------------------------------------------------------- TensorFlow
# A lambda travels by value: unpickling it does not import this (torch-importing) module.
_torch_imported = lambda: "torch" in __import__("sys").modules  # noqa: E731


def test_tensorflow_writes_the_same_layout_without_torch_and_resumes(tmp_path):
    """TFTrainer: epoch-end directories (numpy + meta.json), read back at another size, resumed."""
    pytest.importorskip("tf_keras")
    from examples import tf_digits
    from polytrain import TFTrainer
    from polytrain.launchers.pool import warm_pool as pool

    pool.POOL.clear(wait_s=5.0)  # fresh processes: the torch trainers before left theirs warm
    creators = {"model_creator": tf_digits.model_creator, "data_creator": tf_digits.data_creator}
    config = {"lr": 0.05, "batch_size": 64, "shuffle": False}
    folder = tmp_path / "tf"
    trainer = TFTrainer(
        **creators, config=config, num_workers=2, checkpoint_config={"checkpoint_dir": str(folder)}
    )
    try:
        paths = [trainer.train(num_steps=5)["checkpoint_path"] for _ in range(2)]
        expected = trainer.state_dict()
        assert trainer.apply_all_workers(_torch_imported) == [False, False]
    finally:
        trainer.shutdown()
    manifest = layout.open_checkpoint(paths[-1], framework="tensorflow").manifest
    assert layout.META_JSON in manifest["files"] and manifest["writers"] == 2
    with pytest.raises(CheckpointError, match="tensorflow trainer"):
        layout.open_checkpoint(paths[-1], framework="torch")
    resumed = TFTrainer(
        **creators,
        config=config,
        num_workers=1,
        checkpoint_config={"checkpoint_dir": str(folder), "resume": True},
    )
    try:
        assert resumed.epoch == 2
        got = resumed.state_dict()
        for a, b in zip(expected["models"][0], got["models"][0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(expected["optimizers"][0], got["optimizers"][0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        resumed.train(num_steps=2)
    finally:
        resumed.shutdown()
