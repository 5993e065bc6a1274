"""A Lightning fit on RayStrategy survives a SIGKILLed worker: a new group resumes from Lightning's checkpoint.

Real Ray actors, real gloo. The module is deterministic (no dropout, a fixed data
set, SGD with momentum), so a run that lost a worker in epoch 2 and resumed from the
checkpoint of epoch 1 ends with the weights of a run that lost nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from polytrain.backends.registry import get_spec  # noqa: E402
from polytrain.errors import WorkerDiedError  # noqa: E402
from polytrain.lightning import (  # noqa: E402
    RayDeepSpeedStrategy,
    RayHorovodStrategy,
    RayShardedStrategy,
    RayStrategy,
)

WORKERS = 2
BATCH = 8
BATCHES = 6  # per worker and epoch
EPOCHS = 4
KILL_EPOCH = 2
KILL_STEP = 2  # the killed worker has started at least this many batches of KILL_EPOCH


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(WORKERS * BATCHES * BATCH, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(
        len(x), 1, generator=generator
    )
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    """A small MLP; rank 0 appends ``epoch global_step batch_idx`` of every batch to ``history``.

    Batches of ``slow_epoch`` take 0.1 s longer: the test's killer has time to see that
    epoch on the monitor channel and kill a worker inside it.
    """

    def __init__(self, history: str, slow_epoch: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.history = history
        self.slow_epoch = slow_epoch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        if self.current_epoch == self.slow_epoch:
            time.sleep(0.1)
        if self.global_rank == 0:
            with open(self.history, "a") as file:
                file.write(f"{self.current_epoch} {self.global_step} {batch_idx}\n")
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class _Killer(threading.Thread):
    """SIGKILLs one worker's process once it is ``min_step`` batches into ``epoch`` of the fit."""

    def __init__(self, strategy: RayStrategy, rank: int, epoch: int, min_step: int) -> None:
        super().__init__(daemon=True)
        self.strategy, self.rank, self.epoch, self.min_step = strategy, rank, epoch, min_step
        self.killed_pid: int | None = None
        self.record: dict | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.killed_pid is None:
            group = self.strategy.launcher._group
            try:
                record = group.monitor("progress", timeout_s=5)[self.rank] if group else None
            except IndexError:  # the group was being torn down
                record = None
            if (
                isinstance(record, dict)
                and record.get("epoch") == self.epoch
                and record.get("phase") == "train"
                and record.get("step", 0) >= self.min_step
            ):
                self.record = record
                self.killed_pid = group.metadata[self.rank].pid
                os.kill(self.killed_pid, signal.SIGKILL)
                return
            time.sleep(0.02)


def _trainer(strategy: RayStrategy, root, **kwargs) -> pl.Trainer:
    options = {"logger": False, **kwargs}
    return pl.Trainer(
        strategy=strategy,
        default_root_dir=str(root),
        max_epochs=EPOCHS,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _history(path) -> list[tuple[int, int, int]]:
    with open(path) as file:
        return [tuple(int(v) for v in line.split()) for line in file]


def _epochs(epochs, batches=range(BATCHES)) -> list[tuple[int, int, int]]:
    return [(e, e * BATCHES + b, b) for e in epochs for b in batches]


# Every run restarts a ddp fit; the variants restart through the same launcher (their
# resume goes through their backends' consolidated state): make test-long runs them.
STRATEGIES = [
    pytest.param(RayStrategy, "ddp", id="ddp"),
    pytest.param(RayHorovodStrategy, "horovod", id="horovod", marks=pytest.mark.long_matrix),
    pytest.param(RayShardedStrategy, "fairscale", id="sharded", marks=pytest.mark.long_matrix),
    pytest.param(RayDeepSpeedStrategy, "deepspeed", id="deepspeed", marks=pytest.mark.long_matrix),
]


@pytest.mark.parametrize(("strategy_class", "backend"), STRATEGIES)
def test_killed_worker_resumes_from_the_last_checkpoint(
    strategy_class, backend, tmp_path, caplog, monkeypatch, ray_start_4_cpus, no_leftover_actors
):
    spec = get_spec(backend)
    if not spec.installed:
        pytest.skip(f"backend {backend!r} needs {spec.requires}, not installed here")
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # the distributed sampler's shuffle seed
    caplog.set_level(logging.WARNING, logger="polytrain.lightning")
    reference = Regression(str(tmp_path / "reference.txt"))
    _trainer(strategy_class(num_workers=WORKERS), tmp_path / "reference").fit(reference)

    strategy = strategy_class(num_workers=WORKERS)
    assert strategy.max_retries == 3
    root = tmp_path / "killed"
    trainer = _trainer(
        strategy,
        root,
        logger=CSVLogger(str(root)),
        callbacks=[ModelCheckpoint(save_last=True)],
    )
    model = Regression(str(tmp_path / "killed.txt"), slow_epoch=KILL_EPOCH)
    killer = _Killer(strategy, rank=1, epoch=KILL_EPOCH, min_step=KILL_STEP)
    killer.start()
    trainer.fit(model)
    killer.join(timeout=1)

    assert killer.killed_pid is not None, "the fault was never injected"
    assert strategy.num_restarts == 1
    assert trainer.current_epoch == EPOCHS and trainer.global_step == EPOCHS * BATCHES

    # The restart resumed from the checkpoint of epoch 1 (last.ckpt, or the epoch file
    # written with it) in the logger's pinned version directory: no version_1 appeared.
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    restarts = [
        r.getMessage()
        for r in caplog.records
        if "restart 1 of 3 (RayStrategy max_retries) from" in r.getMessage()
    ]
    assert len(restarts) == 1, [r.getMessage() for r in caplog.records]
    assert restarts[0].startswith(f"Worker rank 1 died (pid {killer.killed_pid} on ")
    source = restarts[0].rsplit(" from ", 1)[1].rstrip(".")
    assert os.path.dirname(source) == str(checkpoints)
    assert os.path.basename(source) in ("last.ckpt", f"epoch=1-step={2 * BATCHES}.ckpt")
    assert not (root / "lightning_logs" / "version_1").exists()

    # Epochs 0 and 1 ran once; epoch 2 ran partly, then fully after the restart (it
    # began after the checkpoint); epoch 3 once. Global steps continue from the checkpoint.
    history = _history(tmp_path / "killed.txt")
    restart_at = next(i for i in range(1, len(history)) if history[i][1] < history[i - 1][1])
    first, second = history[:restart_at], history[restart_at:]
    partial = len(first) - 2 * BATCHES
    assert KILL_STEP <= partial <= BATCHES, first
    assert first == _epochs([0, 1]) + _epochs([KILL_EPOCH], range(partial))
    assert second == _epochs([2, 3])
    assert _history(tmp_path / "reference.txt") == _epochs(range(EPOCHS))

    # The checkpoint lies on an epoch boundary: the weights are those of the run that lost nothing.
    expected = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), f"{key} differs from the uninterrupted run"


def test_max_retries_zero_raises_the_lost_worker(tmp_path, ray_start_4_cpus, no_leftover_actors):
    strategy = RayStrategy(num_workers=WORKERS, max_retries=0)
    trainer = _trainer(strategy, tmp_path)
    killer = _Killer(strategy, rank=1, epoch=0, min_step=KILL_STEP)
    killer.start()
    with pytest.raises(WorkerDiedError, match="Worker rank 1 .*died") as info:
        trainer.fit(Regression(str(tmp_path / "history.txt"), slow_epoch=0))
    killer.join(timeout=1)
    assert killer.killed_pid is not None, "the fault was never injected"
    assert info.value.rank == 1
    assert strategy.num_restarts == 0
