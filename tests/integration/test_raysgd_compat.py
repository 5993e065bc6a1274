"""RaySGD users' code keeps working (issue 15): step semantics, recovery defaults, the calls they used.

Real Ray actors and real gloo process groups, the digits creators of tests/helpers.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from examples import digits
from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.core.torch_distributed import TorchDistributedRendezvous
from polytrain.backends.ddp.backend import DDPBackend
from polytrain.errors import CreatorError, WorkerDiedError
from tests.helpers import DIGITS, max_param_diff
from tests.integration.test_reliability import _Killer

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

CONFIG = {"lr": 0.05, "batch_size": 64}  # 2 workers x 32: 23 batches per worker and epoch
BATCHES_PER_EPOCH = 23


class Indexed(Dataset):
    """The digits training set, each sample with its index: the operator records what it saw."""

    def __init__(self) -> None:
        self.data = digits.load_digits_tensors()[0]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y = self.data[index]
        return x, y, index


def indexed_data_creator(config):
    generator = torch.Generator().manual_seed(0)
    val = digits.load_digits_tensors()[1]
    return (
        DataLoader(Indexed(), batch_size=config["batch_size"], shuffle=True, generator=generator),
        DataLoader(val, batch_size=config["batch_size"]),
    )


class Recording(TrainingOperator):
    """Trains like the default step and records (epoch_idx, batch_idx, global_step, indices)."""

    def setup(self, config):
        self.seen = []

    def train_batch(self, batch, batch_info):
        x, y, index = batch
        self.seen.append(
            (
                batch_info["epoch_idx"],
                batch_info["batch_idx"],
                batch_info["global_step"],
                index.tolist(),
            )
        )
        metrics = super().train_batch((x, y), batch_info)
        return {**metrics, "rank": self.world_rank}


def _recording_trainer(**kwargs):
    return TorchTrainer(
        **{**DIGITS, "data_creator": indexed_data_creator},
        training_operator_cls=Recording,
        config=CONFIG,
        num_workers=2,
        **kwargs,
    )


def test_step_calls_walk_through_the_epoch_and_into_the_next():
    steps = [6] * 6  # 36 batches: epoch 0 (23 batches, the 4th call stops at its end) + 12
    stepwise = _recording_trainer()
    reference = _recording_trainer()
    try:
        stats = [stepwise.train(num_steps=n) for n in steps]
        seen = stepwise.apply_all_operators(lambda op: op.seen)
        reference.train()
        reference.train(num_steps=12)
        reference_seen = reference.apply_all_operators(lambda op: op.seen)
        assert max_param_diff(stepwise.get_model(), reference.get_model()) <= 1e-6
        assert stepwise.epoch == 1
    finally:
        stepwise.shutdown()
        reference.shutdown()
    assert [s["num_steps"] for s in stats] == [6, 6, 6, 5, 6, 6]
    assert [s["epoch"] for s in stats] == [0, 0, 0, 0, 1, 1]
    assert seen == reference_seen  # the same batches, in the same order
    for rank_seen in seen:
        assert [s[1] for s in rank_seen] == list(range(23)) + list(range(12))  # batch_idx
        assert [s[2] for s in rank_seen] == list(range(35))  # global_step
        assert [s[0] for s in rank_seen] == [0] * 23 + [1] * 12  # epoch_idx
    epoch0 = [i for rank_seen in seen for e, _, _, batch in rank_seen if e == 0 for i in batch]
    # Every training sample once (the distributed sampler pads 1437 to 1438 with one repeat).
    assert sorted(set(epoch0)) == list(range(1437)) and len(epoch0) == 1438
    epoch1 = [i for rank_seen in seen for e, _, _, batch in rank_seen if e == 1 for i in batch]
    assert len(set(epoch1)) == len(epoch1) == 2 * 12 * 32  # continued, nothing repeated
    assert seen[0][23][3] != seen[0][0][3]  # epoch 1 reshuffled


def test_profile_raw_results_and_validate_steps():
    trainer = _recording_trainer()
    try:
        profiled = trainer.train(num_steps=3, profile=True)
        raw = trainer.train(num_steps=2, reduce_results=False)
        val = trainer.validate(num_steps=2, profile=True)
    finally:
        trainer.shutdown()
    profile = profiled["profile"]
    phases = ("data_s", "forward_s", "backward_s", "step_s", "other_s")
    for key in (*phases, "total_s", "max_total_s", "reduce_s", "driver_s"):
        assert profile[key] >= 0.0, key
    assert profile["backward_s"] > 0 and profile["forward_s"] > 0
    assert sum(profile[k] for k in phases) == pytest.approx(profile["total_s"], rel=1e-6)
    assert isinstance(raw, list) and [r["rank"] for r in raw] == [0, 1]  # rank order
    assert all(r["num_samples"] == 64 and r["epoch"] == 0 for r in raw)  # each worker's own
    assert val["num_steps"] == 2 and val["num_samples"] == 2 * 2 * 32
    assert val["profile"]["forward_s"] > 0


class WholeLoaderEpoch(TrainingOperator):
    """A RaySGD-style custom train_epoch that iterates everything it is given."""

    def train_epoch(self, iterator, info):
        batches = [len(batch[1]) for batch in iterator]
        return {"num_steps": len(batches), "num_samples": sum(batches), "asked": info["num_steps"]}


def test_custom_train_epoch_gets_this_calls_batches():
    trainer = TorchTrainer(
        **DIGITS, training_operator_cls=WholeLoaderEpoch, config=CONFIG, num_workers=2
    )
    try:
        first = trainer.train(num_steps=20)
        second = trainer.train(num_steps=20)  # only 3 batches left in the epoch
        third = trainer.train(num_steps=20)
    finally:
        trainer.shutdown()
    assert (first["num_steps"], first["asked"], first["epoch"]) == (20, 20, 0)
    assert (second["num_steps"], second["epoch"]) == (3, 0)
    assert (third["num_steps"], third["epoch"]) == (20, 1)


def test_update_scheduler_steps_metric_schedulers_on_every_worker():
    def scheduler_creator(optimizer, config):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

    trainer = TorchTrainer(
        **DIGITS,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq="manual",
        config={"lr": 0.1, "batch_size": 64},
        num_workers=2,
    )
    try:
        trainer.train(num_steps=2)
        for _ in range(3):
            trainer.update_scheduler(1.0)  # no improvement after the first: halve twice
        lrs = trainer.apply_all_operators(lambda op: op.optimizer.param_groups[0]["lr"])
    finally:
        trainer.shutdown()
    assert lrs == [pytest.approx(0.025)] * 2


_SHUTDOWNS: list[str] = []


class _RecordingRendezvous(TorchDistributedRendezvous):
    def on_shutdown(self, group):
        _SHUTDOWNS.append("on_shutdown")
        super().on_shutdown(group)


class _RecordingDDP(DDPBackend):
    rendezvous_cls = _RecordingRendezvous


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("force", [False, True])
def test_forced_shutdown_kills_workers_without_the_clean_up_call(force):
    _SHUTDOWNS.clear()
    trainer = TorchTrainer(**DIGITS, config=CONFIG, num_workers=2, backend=_RecordingDDP())
    trainer.train(num_steps=1)
    pids = [meta.pid for meta in trainer._group.metadata]
    trainer.shutdown(force=force)
    assert _SHUTDOWNS == ([] if force else ["on_shutdown"])
    if force:  # killed, not kept warm for another trainer
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids)


def _hook():
    # Runs before the rendezvous: no process group yet; the creators see what it set.
    os.environ["POLYTRAIN_HOOK_SAW_PROCESS_GROUP"] = str(torch.distributed.is_initialized())


def _hooked_model_creator(config):
    if "POLYTRAIN_HOOK_SAW_PROCESS_GROUP" not in os.environ:
        raise RuntimeError("init_hook did not run before model_creator")
    return digits.model_creator(config)


def _hook_result():
    return os.environ.get("POLYTRAIN_HOOK_SAW_PROCESS_GROUP"), os.getpid()


class SlowAfterEpoch0(TrainingOperator):
    """Steps of epoch 1 take long enough for the killer thread to catch one mid-call."""

    def train_batch(self, batch, batch_info):
        if batch_info["epoch_idx"] >= 1:
            time.sleep(0.3)
        return super().train_batch(batch, batch_info)


def test_default_retries_recover_mid_epoch_from_a_file_and_the_hook_runs_again():
    """A worker lost in the middle of an epoch (no failure_config: 3 retries by default).

    The restart loads the last epoch end's state from what the workers wrote (the
    driver never held it), and the repeated call starts the current epoch over:
    the weights equal a run that trained epoch 0 and then the failed call's steps.
    """
    trainer = TorchTrainer(
        **{**DIGITS, "model_creator": _hooked_model_creator},
        training_operator_cls=SlowAfterEpoch0,
        config=CONFIG,
        num_workers=2,
        init_hook=_hook,
    )
    reference = TorchTrainer(
        **DIGITS, training_operator_cls=SlowAfterEpoch0, config=CONFIG, num_workers=2
    )
    try:
        trainer.train()
        assert trainer.checkpoint_manager.latest is None  # no tensors on the driver
        state_file = trainer.recovery.latest.path  # written on the workers' side
        assert os.path.exists(state_file)
        trainer.train(num_steps=5)  # epoch 1, batches 0-4: rolled back by the restart
        before = trainer.apply_all_workers(_hook_result)
        killer = _Killer(trainer, rank=1, epoch=1, min_step=2)
        killer.start()
        stats = trainer.train(num_steps=5)
        killer.join(timeout=5)
        after = trainer.apply_all_workers(_hook_result)
        reference.train()
        reference.train(num_steps=5)
        ours, theirs = trainer.state_dict()["models"][0], reference.state_dict()["models"][0]
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
        # A call's own budget: no retry for this one.
        killer = _Killer(trainer, rank=0, epoch=1, min_step=1)
        killer.start()
        with pytest.raises(WorkerDiedError):
            trainer.train(max_retries=0)
        killer.join(timeout=5)
    finally:
        trainer.shutdown()
        reference.shutdown()
    assert killer.killed_pid is not None
    assert stats["num_restarts"] == 1 and stats["epoch"] == 1 and stats["num_steps"] == 5
    assert [seen for seen, _ in before] == [seen for seen, _ in after] == ["False", "False"]
    assert {pid for _, pid in before}.isdisjoint(pid for _, pid in after)  # new workers
    assert not os.path.exists(state_file)  # shutdown removed the trainer's temporary files


def test_loggers_get_the_reduced_metrics_of_every_call():
    from polytrain.loggers import Logger

    class Recorder(Logger):
        name = "recorder"

        def __init__(self):
            self.calls = []

        def start(self, run_info):
            self.calls.append(("start", run_info))

        def log_metrics(self, metrics, step, epoch, prefix):
            self.calls.append((prefix, step, epoch, metrics["num_samples"]))

        def finish(self):
            self.calls.append(("finish",))

    recorder = Recorder()
    trainer = TorchTrainer(**DIGITS, config=CONFIG, num_workers=2, loggers=[recorder])
    trainer.train(num_steps=3)
    trainer.train(num_steps=2)
    trainer.validate()
    trainer.shutdown()
    (start, run_info), *logged, finish = recorder.calls
    assert start == "start" and finish == ("finish",)
    assert run_info["backend"] == "ddp" and run_info["num_workers"] == 2
    assert run_info["config"]["lr"] == 0.05 and run_info["framework"] == "torch"
    # Reduced over the 2 workers: one record per call, samples of both workers.
    assert logged == [("train", 3, 0, 3 * 64), ("train", 5, 0, 2 * 64), ("val", 5, 0, 360)]


# ------------------------------------------------------------ several models (issue 31)
# The shape of RaySGD's own multi-model tests: test_torch.py's test_multi_model and
# test_torch_runner.py's TestTorchRunner.testMultiModel / testGivens.
def two_models(config):
    return [digits.model_creator(config), digits.model_creator({**config, "seed": 1})]


def two_optimizers(models, config):
    return [torch.optim.SGD(model.parameters(), lr=config["lr"]) for model in models]


def three_models(config):
    return torch.nn.Linear(64, 10), torch.nn.Linear(64, 10), torch.nn.Linear(64, 10)


def three_optimizers(models, config):
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    return opts[0], opts[1], opts[2]


MULTI = {**DIGITS, "model_creator": two_models, "optimizer_creator": two_optimizers}


class MultiModelOperator(TrainingOperator):
    """RaySGD's test_multi_model: train_epoch trains every model on the same batches."""

    def train_epoch(self, iterator, info):
        data = list(iterator)
        result = {"num_samples": sum(len(y) for _, y in data)}
        for i, (model, optimizer) in enumerate(zip(self.models, self.optimizers, strict=True)):
            model.train()
            total = 0.0
            for x, y in data:
                optimizer.zero_grad()
                loss = self.criterion(model(x), y)
                self.backward(loss)
                optimizer.step()
                total += loss.item()
            result[f"model_{i}_loss"] = total / len(data)
        return result


def test_multi_model_operator_trains_every_model_and_restores_them():
    first = TorchTrainer(
        **MULTI, training_operator_cls=MultiModelOperator, config=CONFIG, num_workers=2
    )
    try:
        initial = first.get_model()
        stats = first.train(num_steps=5)
        state = first.state_dict()
        trained = first.get_model()
    finally:
        first.shutdown()
    assert type(trained) is list and len(trained) == 2  # as model_creator returned them
    assert {"model_0_loss", "model_1_loss"} <= stats.keys()
    for before, after in zip(initial, trained, strict=True):
        assert max_param_diff(before, after) > 0  # each model trained, not only the first
    second = TorchTrainer(
        **MULTI, training_operator_cls=MultiModelOperator, config=CONFIG, num_workers=2
    )
    try:
        second.load_state_dict(state)
        restored = second.get_model()
    finally:
        second.shutdown()
    for model_1, model_2 in zip(trained, restored, strict=True):
        state_1, state_2 = model_1.state_dict(), model_2.state_dict()
        assert state_1.keys() == state_2.keys()
        assert all(torch.equal(state_1[k], state_2[k]) for k in state_1)


class GivensOperator(TrainingOperator):
    """RaySGD's testGivens: setup replaces train_epoch and validate on the instance."""

    def setup(self, config):
        self.train_epoch = lambda iterator, info: {"num_samples": 1, "mean_accuracy": 10}
        self.validate = lambda iterator, info: {"num_samples": 1, "mean_accuracy": 10}


def test_an_operator_that_replaces_train_epoch_in_setup_gets_every_model():
    trainer = TorchTrainer(
        **{**DIGITS, "model_creator": three_models, "optimizer_creator": three_optimizers},
        training_operator_cls=GivensOperator,
        config=CONFIG,
        num_workers=2,
    )
    try:
        given = trainer.apply_all_operators(lambda op: (len(op.models), len(op.optimizers)))
        assert trainer.train()["mean_accuracy"] == 10
    finally:
        trainer.shutdown()
    assert given == [(3, 3), (3, 3)]


class DefaultStepsInOwnEpoch(TrainingOperator):
    """A custom train_epoch that still hands every batch to the default train_batch."""

    def train_epoch(self, iterator, info):
        return super().train_epoch(iterator, info)


def test_the_default_step_with_several_models_is_refused():
    three = {**DIGITS, "model_creator": three_models, "optimizer_creator": three_optimizers}
    # testMultiModel: the default operator would train only the first: refused at setup.
    with pytest.raises(CreatorError, match="model_creator returned 3 objects"):
        TorchTrainer(**three, config=CONFIG, num_workers=2)
    # Through a custom train_epoch the default step is refused when it runs.
    trainer = TorchTrainer(
        **three, training_operator_cls=DefaultStepsInOwnEpoch, config=CONFIG, num_workers=2
    )
    try:
        with pytest.raises(CreatorError, match="model_creator returned 3 objects"):
            trainer.train(num_steps=1, max_retries=0)
    finally:
        trainer.shutdown()
