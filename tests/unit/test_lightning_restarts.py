"""Restarts of the Lightning strategies without Ray: max_retries, the decision, the checkpoint found, the loop."""

from __future__ import annotations

import logging
import os
import types

import pytest

pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

from polytrain.errors import (  # noqa: E402
    ConfigError,
    ConfigTypeError,
    WorkerDiedError,
    WorkerError,
    WorkerHangError,
)
from polytrain.lightning import RayHorovodStrategy, RayStrategy  # noqa: E402
from polytrain.lightning.restarts import (  # noqa: E402
    CheckpointFinder,
    checkpoint_directories,
    is_complete,
    pin_logger_versions,
    with_ckpt_path,
)
from polytrain.runs.policies.failure import describe_loss  # noqa: E402
from polytrain.trainer_api.options.configs import FailureConfig  # noqa: E402
from tests.unit.lightning_loop_fakes import fake_attempts  # noqa: E402

DIED = (
    "Worker rank 1 (pid 4242 on 10.0.0.7) died: The actor died unexpectedly.\n\tclass_name: Worker"
)


# ------------------------------------------------------------ max_retries
def test_max_retries_defaults_to_the_trainers_default():
    assert RayStrategy().max_retries == FailureConfig().max_retries == 3
    assert RayStrategy(max_retries=0).max_retries == 0
    assert RayStrategy().num_restarts == 0


@pytest.mark.parametrize("strategy", [RayStrategy, RayHorovodStrategy])
@pytest.mark.parametrize(
    ("value", "error", "shown"),
    [
        (-1, ConfigError, "got -1. Pass max_retries=0"),
        ("3", ConfigTypeError, "got str: '3'"),
        (True, ConfigTypeError, "got bool: True"),
        (1.5, ConfigTypeError, "got float: 1.5"),
        (None, ConfigTypeError, "got NoneType: None"),
    ],
)
def test_bad_max_retries_names_the_value_and_what_is_allowed(strategy, value, error, shown):
    with pytest.raises(error) as info:
        strategy(max_retries=value)
    message = str(info.value)
    assert message.startswith(f"{strategy.__name__}(max_retries=...) must be an int >= 0")
    assert "0 raises at the first loss" in message
    assert shown in message


# ------------------------------------------------------------ the decision
def test_only_lost_or_hung_workers_are_restarted_within_the_budget():
    died = WorkerDiedError(DIED, rank=1)
    policy = RayStrategy(max_retries=3).failure_policy  # the run loop's policy, per strategy
    assert policy.should_retry(died) and policy.should_retry(WorkerHangError("stuck", rank=0))
    assert not RayStrategy(max_retries=0).failure_policy.should_retry(died)
    assert not policy.should_retry(WorkerError("user code raised", rank=1))
    assert not policy.should_retry(ValueError("bad"))
    assert not policy.should_retry(KeyboardInterrupt())
    for _ in range(3):
        policy.record_restart(died)
    assert not policy.should_retry(died)


def test_the_log_line_names_rank_pid_and_cause():
    line = describe_loss(WorkerDiedError(DIED, rank=1))
    assert line == "Worker rank 1 died (pid 4242 on 10.0.0.7: The actor died unexpectedly.)"
    assert describe_loss(WorkerHangError("no progress for 60 s", rank=2)).startswith(
        "Worker rank 2 hung (no progress"
    )


# ------------------------------------------------------------ the checkpoint to resume from
def _save(path, value=1) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"global_step": value}, path)
    return str(path)


def _age(path, seconds: float) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - int(seconds * 1e9)))


def test_finder_takes_the_newest_checkpoint_written_since_it_was_made(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    old = _save(directory / "epoch=9-step=90.ckpt")  # an earlier run's
    (directory / "notes.txt").write_text("not a checkpoint")
    finder = CheckpointFinder([str(directory), str(tmp_path / "missing")])
    assert finder.newest() is None
    assert "no checkpoint of this fit yet in" in finder.describe_none()

    first = _save(directory / "epoch=0-step=5.ckpt", 5)
    _age(first, 2)
    second = _save(directory / "last.ckpt", 10)
    assert finder.newest() == second
    # A checkpoint cut short while being written is skipped for the one before it.
    with open(second, "r+b") as file:
        file.truncate(os.path.getsize(second) // 2)
    assert not is_complete(second)
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        assert finder.newest() == first
    assert "the file is incomplete" in caplog.text
    # The earlier run's file counts once it is rewritten.
    _save(old, 20)
    assert finder.newest() == old


def test_finder_without_directories_says_why():
    assert "enable_checkpointing=True" in CheckpointFinder([]).describe_none()
    unknown = CheckpointFinder([], ["ModelCheckpoint(dirpath='memory://x'): not a local path"])
    assert "not watched: ModelCheckpoint(dirpath='memory://x')" in unknown.describe_none()


def test_finder_follows_links_and_skips_dangling_ones(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    finder = CheckpointFinder([str(directory)])
    target = _save(directory / "epoch=1-step=4.ckpt")
    _age(target, 5)
    os.symlink(target, directory / "last.ckpt")  # ModelCheckpoint(save_last="link")
    os.symlink(directory / "gone.ckpt", directory / "dangling.ckpt")
    assert finder.newest() in (target, str(directory / "last.ckpt"))


def _trainer(tmp_path, **kwargs) -> pl.Trainer:
    options = {"logger": False, **kwargs}
    return pl.Trainer(
        strategy=RayStrategy(num_workers=2),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        **options,
    )


def test_directories_are_lightnings_checkpoint_directories(tmp_path):
    trainer = _trainer(tmp_path)
    assert checkpoint_directories(trainer) == ([str(tmp_path / "checkpoints")], [])

    # Lightning keeps the states of several ModelCheckpoints apart by their settings.
    explicit = ModelCheckpoint(dirpath=str(tmp_path / "mine"), every_n_epochs=1)
    weights = ModelCheckpoint(
        dirpath=str(tmp_path / "weights"), save_weights_only=True, every_n_epochs=2
    )
    remote = ModelCheckpoint(dirpath="memory://run/checkpoints", every_n_epochs=3)
    trainer = _trainer(tmp_path, callbacks=[explicit, weights, remote])
    directories, unknown = checkpoint_directories(trainer)
    assert directories == [str(tmp_path / "mine")]
    assert any("save_weights_only=True" in text for text in unknown)
    assert any("not a local path" in text for text in unknown)


def test_logger_versions_are_pinned_so_every_group_checkpoints_alike(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)  # an earlier run
    csv = CSVLogger(str(tmp_path))
    trainer = _trainer(tmp_path, logger=csv)
    pin_logger_versions(trainer)
    assert csv._version == 1
    expected = tmp_path / "lightning_logs" / "version_1" / "checkpoints"
    assert checkpoint_directories(trainer) == ([str(expected)], [])


def _fit_impl(model, train_dataloaders=None, val_dataloaders=None, datamodule=None,
              ckpt_path=None, weights_only=None):  # fmt: skip
    """Stands in for Trainer._fit_impl (the launcher recognises the fit by this name)."""


def test_ckpt_path_is_replaced_wherever_it_was_given():
    args, kwargs = with_ckpt_path(_fit_impl, ("model", None, None, "dm", None, None), {}, "/c")
    assert args == ("model", None, None, "dm", "/c", None) and kwargs == {}
    args, kwargs = with_ckpt_path(_fit_impl, ("model",), {"ckpt_path": "last"}, "/c")
    assert (args, kwargs) == (("model",), {"ckpt_path": "/c"})
    args, kwargs = with_ckpt_path(_fit_impl, ("model",), {"datamodule": "dm"}, "/c")
    assert (args, kwargs) == (("model",), {"datamodule": "dm", "ckpt_path": "/c"})


# ------------------------------------------------------------ the launcher's loop
def _outputs(attempt):
    """An attempt of the fake: rank 0's result, or the error ``attempt()`` returns."""

    def run(loop):
        outcome = attempt()
        if isinstance(outcome, BaseException):
            return outcome
        return [types.SimpleNamespace(trainer_results=outcome)]

    return run


def _fake_launches(monkeypatch, attempts):
    """Each attempt is the next of ``attempts``; returns each one's ``(args, kwargs, drain path)``."""
    return fake_attempts(monkeypatch, [_outputs(attempt) for attempt in attempts])


def test_a_lost_worker_restarts_the_fit_from_the_newest_checkpoint(tmp_path, monkeypatch, caplog):
    trainer = _trainer(tmp_path)
    strategy = trainer.strategy
    written = str(tmp_path / "checkpoints" / "epoch=1-step=8.ckpt")

    def dies_after_a_checkpoint():
        _save(written, 8)  # rank 0 wrote it, then rank 1 died
        return WorkerDiedError(DIED, rank=1)

    calls = _fake_launches(monkeypatch, [dies_after_a_checkpoint, lambda: "done"])
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        result = strategy.launcher.launch(_fit_impl, "model", trainer=trainer)
    assert result == "done"
    assert strategy.num_restarts == 1
    assert calls[0][:2] == (("model",), {})
    assert calls[1][:2] == (("model",), {"ckpt_path": written})
    assert (
        f"Worker rank 1 died (pid 4242 on 10.0.0.7: The actor died unexpectedly.); restart 1 of "
        f"3 (RayStrategy max_retries) from {written}." in caplog.text
    )


def test_without_a_checkpoint_the_fit_starts_over_and_past_max_retries_the_error_is_raised(
    tmp_path, monkeypatch, caplog
):
    trainer = pl.Trainer(
        strategy=RayStrategy(num_workers=2, max_retries=1),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        logger=False,
    )
    strategy = trainer.strategy
    first, second = WorkerDiedError(DIED, rank=1), WorkerDiedError(DIED, rank=0)
    calls = _fake_launches(monkeypatch, [lambda: first, lambda: second])
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        with pytest.raises(WorkerDiedError) as info:
            strategy.launcher.launch(_fit_impl, "model", trainer=trainer, ckpt_path="given.ckpt")
    assert info.value is second and info.value.rank == 0
    assert strategy.num_restarts == 1
    assert calls[1][:2] == calls[0][:2] == (("model",), {"ckpt_path": "given.ckpt"})
    assert (
        "restart 1 of 1 (RayStrategy max_retries) from ckpt_path='given.ckpt' (no checkpoint of "
        "this fit yet" in caplog.text
    )
    assert "no restart left (RayStrategy max_retries=1, 1 used)" in caplog.text


def test_user_errors_are_never_retried(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    error = WorkerError("Worker rank 0 raised ValueError: bad", rank=0)
    calls = _fake_launches(monkeypatch, [lambda: error])
    with pytest.raises(WorkerError) as info:
        trainer.strategy.launcher.launch(_fit_impl, "model", trainer=trainer)
    assert info.value is error and len(calls) == 1
    assert trainer.strategy.num_restarts == 0


def test_other_calls_run_again_as_they_were(tmp_path, monkeypatch, caplog):
    trainer = _trainer(tmp_path)

    def _validate_impl(model=None, dataloaders=None, ckpt_path=None):
        """Stands in for Trainer._validate_impl."""

    died = WorkerDiedError(DIED, rank=1)
    calls = _fake_launches(monkeypatch, [lambda: died, lambda: [{"acc": 1.0}]])
    with caplog.at_level(logging.WARNING, logger="polytrain.lightning"):
        result = trainer.strategy.launcher.launch(_validate_impl, "m", trainer=trainer)
    assert result == [{"acc": 1.0}] and calls[0] == calls[1]
    assert "restart 1 of 3 (RayStrategy max_retries) from the start of the validate call" in (
        caplog.text
    )
