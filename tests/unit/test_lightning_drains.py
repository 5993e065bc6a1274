"""Drained nodes under the Lightning strategies, without Ray.

The resumable train loaders (a position per epoch, restored once), the notice rank 0
takes from the monitor channel, the stop every rank agrees on through Lightning's
per-batch broadcast, the driver's poll and loop (preemptions counted apart from
restarts), and a real Lightning fit in this process stopped at a batch by a notice and
resumed from its checkpoint with the weights of a fit that never stopped.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import types
from typing import Any

import pytest

pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402
from pytorch_lightning.strategies import SingleDeviceStrategy  # noqa: E402
from pytorch_lightning.trainer.states import RunningStage  # noqa: E402
from pytorch_lightning.utilities.exceptions import SIGTERMException  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from polytrain.errors import ConfigError, ConfigTypeError, PreemptedError  # noqa: E402
from polytrain.launchers.worker import STOP_HANDLER, WORKER_STATE, Worker  # noqa: E402
from polytrain.lightning import RayDeepSpeedStrategy, RayStrategy, drain_stop, resumable_loaders  # noqa: E402
from polytrain.lightning.restarts import CheckpointFinder  # noqa: E402
from polytrain.runs.watch.drains import DrainWatch  # noqa: E402
from tests.unit.lightning_loop_fakes import fake_attempts  # noqa: E402


# ------------------------------------------------------------------ resumable loaders
def _dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(float(n)))


def _loader(num_workers: int = 0, persistent: bool = False, epoch: int = 1) -> DataLoader:
    sampler = DistributedSampler(_dataset(), num_replicas=2, rank=1, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    return DataLoader(
        _dataset(),
        batch_size=4,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=persistent,
    )


def _values(batches) -> list[list[float]]:
    return [batch[0].tolist() for batch in batches]


@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [(0, False), (2, False), (2, True)],
    ids=["main", "workers", "persistent"],
)
def test_a_resumable_loader_counts_its_batches_and_skips_a_restored_position_once(
    num_workers, persistent
):
    expected = _values(_loader())
    loader = resumable_loaders.make_resumable(_loader(num_workers, persistent))
    assert isinstance(loader, DataLoader) and type(loader).__name__ == "DataLoader"
    assert resumable_loaders.is_resumable(loader) and len(loader) == len(expected) == 5
    iterator = iter(loader)
    assert _values([next(iterator), next(iterator)]) == expected[:2]
    assert resumable_loaders.loader_position(loader) == 2
    # A resumed fit: the next iteration starts after the 2 batches trained.
    resumable_loaders.resume_at(loader, 2, epoch=1)
    assert _values(loader) == expected[2:]
    assert resumable_loaders.loader_position(loader) == 5
    # Once: the iteration after it is a whole epoch again.
    assert _values(loader) == expected


def test_a_resumable_loader_that_is_not_resumed_iterates_as_before():
    plain = _loader()
    loader = resumable_loaders.make_resumable(_loader())
    assert _values(loader) == _values(plain)
    assert loader.batch_size == plain.batch_size and loader.sampler.epoch == 1
    # Copies are of the user's class again (the resumable class is made at run time).
    for copied in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(copied) is DataLoader and _values(copied) == _values(plain)
    assert resumable_loaders.make_resumable(loader) is loader  # idempotent


def test_resume_at_sets_the_epoch_before_the_iterator_exists():
    # Loader workers draw their indices when the iterator is made: the epoch must be right then.
    loader = resumable_loaders.make_resumable(_loader(epoch=0))
    resumable_loaders.resume_at(loader, 1, epoch=3)
    assert loader.sampler.epoch == 3
    assert _values(loader) == _values(_loader(epoch=3))[1:]


class _OwnIteration(DataLoader):
    def __iter__(self):
        return super().__iter__()


class _Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_loaders_that_cannot_keep_a_position_are_named():
    assert resumable_loaders.why_not_resumable(_loader()) is None
    assert "not a torch DataLoader" in resumable_loaders.why_not_resumable([1, 2])
    assert "IterableDataset" in resumable_loaders.why_not_resumable(DataLoader(_Numbers()))
    assert "iterates its own way" in resumable_loaders.why_not_resumable(_OwnIteration(_dataset()))


class _StatefulLoader(DataLoader):
    def state_dict(self) -> dict:
        return {"mine": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def _fit_state(ready: int, total: int, flattened: list, epoch: int = 1) -> Any:
    """The parts of a Trainer that ResumableLoaders reads."""
    epoch_loop = types.SimpleNamespace(
        batch_progress=types.SimpleNamespace(current=types.SimpleNamespace(ready=ready))
    )
    fit_loop = types.SimpleNamespace(
        _combined_loader=types.SimpleNamespace(flattened=flattened),
        epoch_loop=epoch_loop,
        epoch_progress=types.SimpleNamespace(current=types.SimpleNamespace(processed=epoch)),
    )
    return types.SimpleNamespace(fit_loop=fit_loop, num_training_batches=total)


def test_positions_round_trip_through_a_checkpoint_and_only_mid_epoch():
    saving = resumable_loaders.ResumableLoaders(world_size=2)
    loader = saving.track(_loader())
    stateful = _StatefulLoader(_dataset(), batch_size=4)
    assert saving.track(stateful) is stateful and not resumable_loaders.is_resumable(
        stateful
    )  # Lightning's
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)
    checkpoint: dict = {}
    saving.on_save_checkpoint(_fit_state(3, 5, [loader, stateful]), None, checkpoint)
    assert checkpoint[resumable_loaders.POSITIONS_KEY] == {
        "world_size": 2,
        "epoch": 1,
        "loaders": [{"batches": 3, "length": 5}, None],
    }
    at_the_end: dict = {}
    saving.on_save_checkpoint(_fit_state(5, 5, [loader]), None, at_the_end)
    assert (
        resumable_loaders.POSITIONS_KEY not in at_the_end
    )  # the next epoch starts from its first batch

    resumed = resumable_loaders.ResumableLoaders(world_size=2)
    resumed.on_load_checkpoint(None, None, checkpoint)
    fresh = resumed.track(_loader(epoch=0))
    assert resumed.track(_StatefulLoader(_dataset(), batch_size=4)) is not None
    assert fresh.sampler.epoch == 1
    assert _values(fresh) == _values(_loader())[3:]


def test_a_position_of_another_world_size_or_length_is_not_applied(caplog):
    checkpoint = {
        resumable_loaders.POSITIONS_KEY: {
            "world_size": 4,
            "epoch": 0,
            "loaders": [{"batches": 2, "length": 5}],
        }
    }
    other = resumable_loaders.ResumableLoaders(world_size=2)
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        other.on_load_checkpoint(None, None, checkpoint)
    assert "saved by 4 workers, this fit has 2" in caplog.text
    assert _values(other.track(_loader())) == _values(_loader())

    checkpoint[resumable_loaders.POSITIONS_KEY]["world_size"] = 2
    checkpoint[resumable_loaders.POSITIONS_KEY]["loaders"][0]["length"] = 9
    shorter = resumable_loaders.ResumableLoaders(world_size=2)
    shorter.on_load_checkpoint(None, None, checkpoint)
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        assert _values(shorter.track(_loader())) == _values(_loader())
    assert "for a loader of 9 batches, this one has 5" in caplog.text


def test_the_strategy_tracks_train_loaders_of_a_fit_only():
    strategy = RayStrategy(num_workers=2)
    loader = _loader()
    assert strategy.process_dataloader(loader) is loader  # the driver: nothing
    strategy._loader_positions = resumable_loaders.ResumableLoaders(2)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(stage=RunningStage.VALIDATING))
    strategy._lightning_module = types.SimpleNamespace(_trainer=trainer)
    assert not resumable_loaders.is_resumable(strategy.process_dataloader(loader))
    trainer.state.stage = RunningStage.TRAINING
    assert resumable_loaders.is_resumable(strategy.process_dataloader(loader))


# ------------------------------------------------------------------ the notice and the stop
def test_rank_zero_takes_the_notice_from_the_monitor_channel():
    notice = drain_stop.DrainNotice()
    WORKER_STATE[STOP_HANDLER] = notice
    try:
        worker = Worker.__new__(Worker)  # the actor's method, without an actor
        assert Worker.stop_request(worker, {"target": None}) is None  # not a drain notice
        assert not notice.requested
        assert Worker.stop_request(worker, {"drain": True}) == {"ok": True}
        assert notice.requested
    finally:
        WORKER_STATE.pop(STOP_HANDLER, None)
    refused = drain_stop.DrainNotice(refusal="no broadcast")
    assert refused({"drain": True}) == {"ok": False, "why": "no broadcast"}
    assert not refused.requested


def test_the_drivers_reading_of_the_answer():
    assert drain_stop.notice_reply(None) == (False, None)  # no handler yet: send again
    assert drain_stop.notice_reply({"ok": True}) == (True, None)
    assert drain_stop.notice_reply({"ok": False, "why": "w"}) == (True, "w")


def test_sigterm_wins_and_a_drain_is_told_apart():
    assert drain_stop.stop_code(False, False) == drain_stop.GO_ON
    assert drain_stop.stop_code(True, False) == drain_stop.DRAIN
    assert drain_stop.stop_code(True, True) == drain_stop.SIGTERM
    drain_stop.raise_for(drain_stop.GO_ON)
    with pytest.raises(drain_stop.DrainStop):
        drain_stop.raise_for(drain_stop.DRAIN)
    with pytest.raises(SIGTERMException) as info:
        drain_stop.raise_for(drain_stop.SIGTERM)
    assert not isinstance(info.value, drain_stop.DrainStop)
    assert issubclass(drain_stop.DrainStop, SystemExit)  # `except Exception` lets it through


class _EpochLoop:
    """Lightning's epoch loop as far as install_stop needs it."""

    def __init__(self, rank: int = 0) -> None:
        self.trainer = types.SimpleNamespace(
            received_sigterm=False,
            strategy=types.SimpleNamespace(root_device=torch.device("cpu")),
        )
        self.trainer.fit_loop = types.SimpleNamespace(epoch_loop=self)
        self.rank = rank
        self.advanced = 0

    def _broadcast_sigterm_tensor(self) -> None:
        raise AssertionError("replaced")

    def advance(self, data_fetcher: Any) -> None:
        self.advanced += 1


def _fake_collectives(monkeypatch, root_value: int | None) -> list[str]:
    """torch.distributed with rank 0 sending ``root_value`` (None: the broadcast fails)."""
    calls: list[str] = []

    def broadcast(tensor, src):
        calls.append("broadcast")
        if root_value is None:
            raise RuntimeError("gloo: connection closed")
        tensor.fill_(root_value)

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    return calls


def test_several_workers_stop_together_through_lightnings_one_broadcast(monkeypatch):
    loop, notice = _EpochLoop(), drain_stop.DrainNotice()
    assert drain_stop.install_stop(loop.trainer, notice, world_size=2) is None
    calls = _fake_collectives(monkeypatch, drain_stop.GO_ON)
    loop._broadcast_sigterm_tensor()  # nothing asked: go on
    assert calls == ["broadcast"]
    # Rank 1 learns rank 0's decision from the same broadcast: a drain, told apart.
    calls = _fake_collectives(monkeypatch, drain_stop.DRAIN)
    with pytest.raises(drain_stop.DrainStop):
        loop._broadcast_sigterm_tensor()
    assert calls == ["broadcast", "barrier"]
    _fake_collectives(monkeypatch, drain_stop.SIGTERM)
    with pytest.raises(SIGTERMException) as info:
        loop._broadcast_sigterm_tensor()
    assert not isinstance(info.value, drain_stop.DrainStop)
    _fake_collectives(monkeypatch, None)
    loop._broadcast_sigterm_tensor()  # as Lightning: a failed broadcast stops nobody


def test_rank_zero_sends_what_it_was_told(monkeypatch):
    loop, notice = _EpochLoop(), drain_stop.DrainNotice()
    drain_stop.install_stop(loop.trainer, notice, world_size=2)
    sent: list[int] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src: sent.append(int(t.item())))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    loop._broadcast_sigterm_tensor()
    notice.request()
    with pytest.raises(drain_stop.DrainStop):
        loop._broadcast_sigterm_tensor()
    assert sent == [drain_stop.GO_ON, drain_stop.DRAIN]


def test_a_single_worker_stops_at_the_start_of_the_next_batch():
    loop, notice = _EpochLoop(), drain_stop.DrainNotice()
    assert drain_stop.install_stop(loop.trainer, notice, world_size=1) is None
    loop.advance(None)
    notice.request()
    with pytest.raises(drain_stop.DrainStop):
        loop.advance(None)
    assert loop.advanced == 1


def test_without_lightnings_broadcast_the_notice_is_refused():
    loop = _EpochLoop()
    loop._broadcast_sigterm_tensor = None
    why = drain_stop.install_stop(loop.trainer, drain_stop.DrainNotice(), world_size=2)
    assert "no per-batch stop broadcast" in why


def test_the_drain_checkpoint_appears_complete_or_not_at_all(tmp_path):
    path = drain_stop.drain_checkpoint_path(str(tmp_path), "abc", 1)
    assert path == str(tmp_path / "drain_checkpoints" / "drain-abc-1.ckpt")
    finder = CheckpointFinder.for_trainer(
        types.SimpleNamespace(checkpoint_callbacks=[], loggers=[], default_root_dir=str(tmp_path)),
        extra=[drain_stop.drain_directory(str(tmp_path))],
    )
    seen: list[Any] = []

    class _Trainer:
        def save_checkpoint(self, filepath: str) -> None:
            os.makedirs(os.path.dirname(filepath), exist_ok=True)
            torch.save({"global_step": 3}, filepath)
            seen.append(finder.newest())  # while written: not a candidate

    drain_stop.save_drain_checkpoint(_Trainer(), path, is_rank_zero=True)
    assert seen == [None]
    assert finder.newest() == path and not os.path.exists(path + ".part")
    drain_stop.remove_checkpoint(path)
    assert not os.path.exists(os.path.dirname(path))  # the empty directory goes too


# ------------------------------------------------------------------ max_preemptions
def test_max_drains_is_unlimited_by_default_and_checked():
    strategy = RayStrategy()
    assert strategy.max_drains is None and strategy.num_drains == 0
    assert RayDeepSpeedStrategy(max_drains=2).max_drains == 2
    with pytest.raises(ConfigError, match=r"got -1\. Pass max_drains=0"):
        RayStrategy(max_drains=-1)
    with pytest.raises(ConfigTypeError, match="got bool: True"):
        RayStrategy(max_drains=True)


def test_max_preemptions_is_the_former_name_of_max_drains():
    with pytest.warns(DeprecationWarning, match="max_preemptions=...\\) is now max_drains"):
        strategy = RayStrategy(max_preemptions=2)
    assert strategy.max_drains == 2 and strategy.drain_policy.max_drains == 2
    with pytest.warns(DeprecationWarning):
        assert strategy.num_preemptions == 0
    with pytest.raises(ConfigError, match="set max_drains only"):
        RayStrategy(max_drains=1, max_preemptions=2)


# ------------------------------------------------------------------ the driver's poll
class _Group:
    """A started group as the poll sees it: placements and rank 0's monitor channel."""

    def __init__(self, answers: list[Any]) -> None:
        self.metadata = [
            types.SimpleNamespace(node_id="a", node_ip="10.0.0.1"),
            types.SimpleNamespace(node_id="b", node_ip="10.0.0.2"),
        ]
        self.answers = answers
        self.sent: list[tuple[int, str, Any]] = []

    def monitor_single_async(self, rank: int, method: str, *args: Any) -> int:
        self.sent.append((rank, method, *args))
        return len(self.sent)

    def poll(self, ref: int) -> tuple[bool, Any]:
        return True, self.answers[ref - 1]


def _fit_impl(model, train_dataloaders=None, val_dataloaders=None, datamodule=None,
              ckpt_path=None, weights_only=None):  # fmt: skip
    """Stands in for Trainer._fit_impl (the launcher recognises the fit by this name)."""


def _validate_impl(model=None, dataloaders=None, ckpt_path=None):
    """Stands in for Trainer._validate_impl."""


def _watched_call(tmp_path, draining: dict, group: _Group, function=_fit_impl):
    """A launcher call on a run loop whose group is ``group`` and whose drain watch reads ``draining``."""
    from polytrain.lightning.launcher import _EntryCall
    from polytrain.runs.loop import RunLoop

    trainer = _trainer(tmp_path)
    call = _EntryCall(trainer.strategy, trainer, function, (), {})
    loop = RunLoop(
        call,
        trainer.strategy.backend,
        trainer.strategy.scaling,
        failure_policy=trainer.strategy.failure_policy,
    )
    loop.drain_watch = DrainWatch(draining=lambda: draining, interval_s=0.0)
    loop.drain_watch.watch(group.metadata)
    loop.group, call.loop = group, loop
    if function is _fit_impl:
        call.drain_path = str(tmp_path / "drain-x-1.ckpt")
    return call, loop


def test_a_drain_of_the_groups_node_tells_rank_zero_until_its_fit_answers(tmp_path, caplog):
    draining: dict = {}
    group = _Group(answers=[None, {"ok": True}])
    call, loop = _watched_call(tmp_path, draining, group)
    loop.poll_drains()
    assert group.sent == [] and loop.pending_drain is None
    draining["b"] = 0
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        loop.poll_drains()  # sees it, sends the notice
        loop.poll_drains()  # no handler yet: None
        loop.poll_drains()  # sends again
        loop.poll_drains()  # taken
        loop.poll_drains()  # nothing more to do
    assert group.sent == [(0, "stop_request", {"drain": True})] * 2
    assert call._notice_done and loop.pending_drain.node_ids == ("b",)
    assert (
        "Node b (10.0.0.2) is draining (preemption, no deadline): the workers (rank 1) finish "
        "their current batch, checkpoint there and the fit continues off the node."
    ) in caplog.text


def test_a_refused_notice_leaves_the_node_to_the_restart_path(tmp_path, caplog):
    group = _Group(answers=[{"ok": False, "why": "no broadcast"}])
    _call, loop = _watched_call(tmp_path, {"a": 0, "b": 0}, group)
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        for _ in range(3):
            loop.poll_drains()
    assert len(group.sent) == 1
    assert "the workers (ranks 0, 1) finish their current batch" in caplog.text
    assert "Rank 0 cannot stop this fit at a batch (no broadcast)" in caplog.text


def test_another_call_is_left_at_once_to_run_again(tmp_path, caplog):
    from polytrain.runs.workload import CallStoppedForDrain

    group = _Group(answers=[])
    _call, loop = _watched_call(tmp_path, {"b": 0}, group, function=_validate_impl)
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        with pytest.raises(CallStoppedForDrain):
            loop.poll_drains()
    assert group.sent == []
    assert "stop the running validate call, which runs again off the node" in caplog.text


# ------------------------------------------------------------------ the driver's loop
def _trainer(tmp_path, **strategy_options) -> pl.Trainer:
    return pl.Trainer(
        strategy=RayStrategy(num_workers=2, **strategy_options),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        logger=False,
    )


def _drain_of_node_b(loop) -> None:
    watch = DrainWatch(draining=lambda: {"b": 0})
    watch.watch([types.SimpleNamespace(node_id="b", node_ip="10.0.0.2")] * 2)
    loop.pending_drain = watch.poll()


def _stopped(loop) -> list:
    """A fit that a drain of node b stopped at epoch 0, batch 7: its checkpoint written."""
    path = loop.workload.drain_path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"global_step": 7}, path)
    _drain_of_node_b(loop)
    return [drain_stop.DrainStopped(path, 0, 7, 7), drain_stop.DrainStopped(None, 0, 7, 7)]


def test_a_stopped_fit_continues_from_its_drain_checkpoint_as_a_drain(
    tmp_path, monkeypatch, caplog
):
    trainer = _trainer(tmp_path, max_retries=0)
    launcher = trainer.strategy.launcher
    done = [types.SimpleNamespace(trainer_results="done")]
    calls = fake_attempts(monkeypatch, [_stopped, lambda _: done])
    with caplog.at_level(logging.WARNING):
        assert launcher.launch(_fit_impl, "model", trainer=trainer) == "done"
    strategy = trainer.strategy
    assert strategy.num_drains == 1 and strategy.num_restarts == 0
    first_path, second_path = calls[0][2], calls[1][2]
    assert os.path.dirname(first_path) == str(tmp_path / "drain_checkpoints")
    assert calls[0][:2] == (("model",), {})
    assert calls[1][:2] == (("model",), {"ckpt_path": first_path})
    assert second_path != first_path  # a later drain writes a file of its own
    assert not os.path.exists(first_path)  # spent once the fit completed
    assert (
        f"Drain 1 (RayStrategy max_drains=unlimited) of node b: checkpoint "
        f"{first_path} holds epoch 0, batch 7 (global step 7) (no deadline)."
    ) in caplog.text
    assert f"Continuing from {first_path} on 2 worker(s) off the drained node(s)." in (caplog.text)


def test_past_max_drains_the_checkpoint_is_kept_and_named(tmp_path, monkeypatch):
    from polytrain.errors import DrainLimitError

    trainer = _trainer(tmp_path, max_drains=0)
    launcher = trainer.strategy.launcher
    fake_attempts(monkeypatch, [_stopped])
    with pytest.raises(DrainLimitError, match=r"more than RayStrategy max_drains=0") as info:
        launcher.launch(_fit_impl, "model", trainer=trainer)
    path = info.value.checkpoint_path
    assert path is not None and os.path.isfile(path)
    assert f"trainer.fit(model, ckpt_path={path!r})" in str(info.value)
    assert isinstance(info.value, PreemptedError)  # the former name still catches it
    assert trainer.strategy.num_drains == 1


def test_a_validate_call_left_for_a_drain_runs_again(tmp_path, monkeypatch, caplog):
    from polytrain.runs.workload import CallStoppedForDrain, DrainCheckpoint

    trainer = _trainer(tmp_path, max_retries=0)
    launcher = trainer.strategy.launcher

    def left(loop):
        _drain_of_node_b(loop)
        where = DrainCheckpoint(None, "the validate call", "Run the validate call again")
        return CallStoppedForDrain(loop.pending_drain, where)

    results = [types.SimpleNamespace(trainer_results=[{"acc": 1.0}])]
    calls = fake_attempts(monkeypatch, [left, lambda _: results])
    with caplog.at_level(logging.WARNING):
        assert launcher.launch(_validate_impl, "m", trainer=trainer) == [{"acc": 1.0}]
    assert calls[0] == calls[1] == (("m",), {}, None)
    assert trainer.strategy.num_drains == 1 and trainer.strategy.num_restarts == 0
    assert "of node b: the validate call stopped (no deadline)" in caplog.text


def test_a_node_lost_before_the_stop_is_a_lost_worker(tmp_path, monkeypatch, caplog):
    from polytrain.errors import WorkerDiedError

    trainer = _trainer(tmp_path, max_retries=1)
    launcher = trainer.strategy.launcher

    def lost(loop):
        _drain_of_node_b(loop)
        return WorkerDiedError("Worker rank 1 (pid 7 on 10.0.0.2) died: node gone", rank=1)

    done = [types.SimpleNamespace(trainer_results="done")]
    fake_attempts(monkeypatch, [lost, lambda _: done])
    with caplog.at_level(logging.WARNING):
        assert launcher.launch(_fit_impl, "model", trainer=trainer) == "done"
    assert trainer.strategy.num_restarts == 1 and trainer.strategy.num_drains == 0
    assert (
        "Node b (10.0.0.2) is draining (preemption, no deadline), and the group lost a worker "
        "before it stopped there (the node is gone): a restart from the latest state, as after "
        "any lost worker (RayStrategy max_retries=1)."
    ) in caplog.text
    assert "restart 1 of 1 (RayStrategy max_retries) from" in caplog.text


# ------------------------------------------------------------------ a real fit, stopped and resumed
BATCHES = 6  # per epoch
EPOCHS = 2


class _Regression(pl.LightningModule):
    def __init__(self, history: list) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.history = history

    def training_step(self, batch, batch_idx):
        self.history.append((self.current_epoch, batch_idx))
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(BATCHES * 4, 4, generator=generator)
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=4, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _Tracking(SingleDeviceStrategy):
    """One process, with the train loaders tracked as RayStrategy's workers track them."""

    def __init__(self, positions: resumable_loaders.ResumableLoaders) -> None:
        super().__init__(device=torch.device("cpu"))
        self.positions = positions

    def process_dataloader(self, dataloader):
        if self.lightning_module.trainer.state.stage == RunningStage.TRAINING:
            return self.positions.track(dataloader)
        return dataloader


class _AskAt(pl.Callback):
    """Plays the driver: asks for the stop once batch ``at`` of epoch 0 ran."""

    def __init__(self, notice: drain_stop.DrainNotice, at: int) -> None:
        self.notice, self.at = notice, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (0, self.at):
            self.notice.request()


def _trainer_in_process(root, validate_every: int | None, *callbacks) -> pl.Trainer:
    positions = resumable_loaders.ResumableLoaders(world_size=1)
    validation = (
        {"val_check_interval": validate_every, "limit_val_batches": 1}
        if validate_every
        else {"limit_val_batches": 0}
    )
    return pl.Trainer(
        strategy=_Tracking(positions),
        max_epochs=EPOCHS,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[positions, *callbacks],
        **validation,
    )


@pytest.mark.parametrize("validate_every", [None, 3], ids=["train", "validated-before-the-stop"])
def test_a_fit_stopped_at_a_batch_resumes_with_the_next_batch_and_equal_weights(
    tmp_path, validate_every
):
    reference_history: list = []
    reference_trainer = _trainer_in_process(tmp_path / "reference", validate_every)
    reference = _Regression(reference_history)
    reference_trainer.fit(reference)
    assert reference_history == [(e, b) for e in range(EPOCHS) for b in range(BATCHES)]

    history: list = []
    notice = drain_stop.DrainNotice()
    trainer = _trainer_in_process(tmp_path / "stopped", validate_every, _AskAt(notice, 2))
    assert drain_stop.install_stop(trainer, notice, world_size=1) is None
    model = _Regression(history)
    # As the worker runs it: the entry point without Lightning's interrupt handling.
    trainer.state.fn = pl.trainer.states.TrainerFn.FITTING
    trainer.state.status = pl.trainer.states.TrainerStatus.RUNNING
    trainer.training = True
    path = drain_stop.drain_checkpoint_path(str(tmp_path), "t", 1)
    with pytest.raises(drain_stop.DrainStop):
        trainer._fit_impl(model)
    stopped = drain_stop.stop_at_drain(trainer, path)
    assert stopped == drain_stop.DrainStopped(path, epoch=0, batch=3, global_step=3)
    assert history == [(0, b) for b in range(3)]
    saved = torch.load(path, weights_only=False)
    assert saved[resumable_loaders.POSITIONS_KEY]["loaders"] == [{"batches": 3, "length": BATCHES}]

    resumed_trainer = _trainer_in_process(tmp_path / "resumed", validate_every)
    resumed = _Regression(history)
    resumed_trainer.fit(resumed, ckpt_path=path)
    assert history == reference_history  # every batch once, in order
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key]), key
    # The logger's step counter too (the x axis of logged metrics).
    steps = [
        t.fit_loop.epoch_loop._batches_that_stepped for t in (resumed_trainer, reference_trainer)
    ]
    assert steps[0] == steps[1]


def test_a_mid_epoch_model_checkpoint_resumes_at_its_batch(tmp_path):
    """What a restart after a lost worker resumes from: ModelCheckpoint(every_n_train_steps=N)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    reference_history: list = []
    reference = _Regression(reference_history)
    _trainer_in_process(tmp_path / "reference", None, every).fit(reference)
    mid_epoch = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"  # after batch 3 of 6
    assert mid_epoch.exists()
    saved = torch.load(mid_epoch, weights_only=False)
    assert saved[resumable_loaders.POSITIONS_KEY]["loaders"] == [{"batches": 4, "length": BATCHES}]

    history = reference_history[:4]
    resumed = _Regression(history)
    _trainer_in_process(tmp_path / "resumed", None).fit(resumed, ckpt_path=str(mid_epoch))
    assert history == reference_history
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key]), key
