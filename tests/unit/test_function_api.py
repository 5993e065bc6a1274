"""The function API without Ray: argument checks, misuse errors, the report board, local mode."""

from __future__ import annotations

import os

import pytest
import torch

from polytrain.errors import CheckpointError, ConfigError, ConfigTypeError
from polytrain.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    RunConfig,
    SessionMisuseError,
    get_checkpoint,
    get_context,
    report,
)
from polytrain.train import torch as train_torch
from polytrain.train.board import ReportBoard
from polytrain.train.torch import TorchTrainer


def test_a_loop_of_two_arguments_is_refused_naming_its_signature():
    def loop(config, extra):
        pass

    with pytest.raises(
        ConfigTypeError, match=r"loop\(config, extra\).*no arguments or exactly one"
    ):
        TorchTrainer(loop)


def test_a_loop_without_arguments_cannot_take_a_config():
    with pytest.raises(ConfigTypeError, match="train_loop_config=\\{'lr': 0.1\\} needs one"):
        TorchTrainer(lambda: None, train_loop_config={"lr": 0.1})


def test_a_loop_that_is_not_callable_is_refused():
    with pytest.raises(ConfigTypeError, match="got str: 'train.py'"):
        TorchTrainer("train.py")


@pytest.mark.parametrize(
    "call",
    [
        lambda: report({"loss": 1.0}),
        get_checkpoint,
        get_context,
        train_torch.get_device,
        lambda: train_torch.prepare_model(torch.nn.Linear(1, 1)),
    ],
)
def test_outside_a_loop_the_session_functions_say_where_to_call_them(call):
    with pytest.raises(SessionMisuseError, match="outside a training loop.*train_loop_per_worker"):
        call()


def test_a_checkpoint_must_be_a_directory(tmp_path):
    file = tmp_path / "model.pt"
    file.write_bytes(b"x")
    with pytest.raises(
        CheckpointError, match=r"model.pt'\): the path is a file; a checkpoint is a directory"
    ):
        Checkpoint.from_directory(file)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.from_directory(tmp_path / "missing")
    with pytest.raises(ConfigTypeError, match="got int: 3"):
        Checkpoint(3)


def test_ray_train_option_names_are_checked():
    with pytest.raises(ConfigError, match="max_failures must be >= -1"):
        FailureConfig(max_failures=-2)
    assert FailureConfig(max_failures=-1).to_polytrain().max_retries > 10**6
    with pytest.raises(ConfigError, match="'max' or 'min'; got 'best'"):
        CheckpointConfig(checkpoint_score_order="best")
    with pytest.raises(ConfigError, match="folder name"):
        RunConfig(name="a/b")
    with pytest.raises(ConfigTypeError, match="Unknown failure_config key"):
        RunConfig(failure_config={"max_retries": 2})
    assert RunConfig(checkpoint_config={"num_to_keep": 2}).checkpoint_config.num_to_keep == 2
    with pytest.raises(ConfigError, match="Unknown logger 'csvv'.*Did you mean 'csv'"):
        RunConfig(loggers=["csvv"])
    with pytest.raises(ConfigError, match=r"callbacks=\[1\]\).*RunConfig\(loggers="):
        RunConfig(callbacks=[1])


def _write(root, index, rank):
    directory = root / f"checkpoint_{index:06d}"
    directory.mkdir(exist_ok=True)
    (directory / f"rank{rank}.pt").write_bytes(b"x")


def test_the_board_commits_a_step_only_when_every_rank_reported_it(tmp_path):
    board = ReportBoard(str(tmp_path), CheckpointConfig(num_to_keep=1))
    assert board.new_attempt(2) == 0
    _write(tmp_path, 0, 0)
    board.report(0, 0, {"loss": 1.0}, True)
    assert not (tmp_path / "checkpoint_000000" / "COMMITTED").exists()
    board.report(0, 1, None, False)  # rank 1 reported without a checkpoint of its own
    assert (tmp_path / "checkpoint_000000" / "COMMITTED").exists()
    _write(tmp_path, 1, 1)
    board.report(1, 1, None, True)  # rank 0 dies before reporting step 1
    assert board.new_attempt(2) == 1  # the partial step is dropped, its directory deleted
    assert not (tmp_path / "checkpoint_000001").exists()
    assert board.latest_checkpoint() == f"{tmp_path}/checkpoint_000000"
    for rank in (0, 1):
        _write(tmp_path, 1, rank)
        board.report(1, rank, {"loss": 0.5} if rank == 0 else None, True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000001"]  # num_to_keep=1
    assert [entry["loss"] for entry in board.snapshot()["history"]] == [1.0, 0.5]
    # a new board on the same run finds the committed checkpoint and its metrics
    again = ReportBoard(str(tmp_path), CheckpointConfig())
    assert again.committed == [(1, {"loss": 0.5})]
    assert again.new_attempt(1) == 2


def local_loop(config):
    ctx = get_context()
    assert (ctx.get_world_rank(), ctx.get_world_size()) == (0, 1)
    assert train_torch.get_device() == torch.device("cpu")
    start = get_checkpoint()
    for step in range(config["steps"]):
        directory = os.path.join(config["scratch"], str(step))
        os.makedirs(directory)
        with open(os.path.join(directory, "step.txt"), "w") as handle:
            handle.write(str(step))
        report(
            {"step": step, "loss": torch.tensor(1.0 / (step + 1)), "resumed": start is not None},
            checkpoint=Checkpoint.from_directory(directory),
        )


def test_local_mode_runs_the_loop_in_this_process(tmp_path):
    def trainer(name, scratch, resume=None):
        return TorchTrainer(
            local_loop,
            train_loop_config={"steps": 3, "scratch": str(tmp_path / scratch)},
            scaling_config={"num_workers": 0},
            run_config=RunConfig(storage_path=str(tmp_path / "runs"), name=name),
            resume_from_checkpoint=resume,
        )

    result = trainer("local", "a").fit()
    assert result.metrics == {"step": 2, "loss": pytest.approx(1 / 3), "resumed": False}
    assert list(result.metrics_dataframe["step"]) == [0, 1, 2]
    with result.checkpoint.as_directory() as directory:
        assert open(os.path.join(directory, "step.txt")).read() == "2"
    copy = result.checkpoint.to_directory(str(tmp_path / "copy"))
    assert sorted(os.listdir(copy))[-1] == "step.txt"
    # another run starts from the given checkpoint until it commits its own
    other = trainer("other", "b", resume=result.checkpoint).fit()
    assert other.metrics["resumed"] is True
    with pytest.raises(SessionMisuseError):
        report({"after": 1})  # the loop has ended


def test_checkpoints_go_to_fsspec_storage(tmp_path):
    """``memory://`` stands in for s3:// / gs:// (one process: local mode)."""
    result = TorchTrainer(
        local_loop,
        train_loop_config={"steps": 2, "scratch": str(tmp_path / "scratch")},
        scaling_config={"num_workers": 0},
        run_config=RunConfig(storage_path="memory://function-api", name="remote"),
    ).fit()
    assert result.path == "memory://function-api/remote"
    assert result.checkpoint.path == "memory://function-api/remote/checkpoint_000001"
    with result.checkpoint.as_directory() as directory:
        assert not directory.startswith("memory:")  # a local copy
        assert open(os.path.join(directory, "step.txt")).read() == "1"
    assert not os.path.exists(directory)  # removed after the block


def helpers_loop(config):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = train_torch.prepare_model(model)
    if config["backend"] == "ddp":
        assert train_torch.prepare_optimizer(optimizer) is optimizer
    else:
        with pytest.raises(ConfigError, match="prepare\\(model, optimizer\\) instead"):
            train_torch.prepare_optimizer(optimizer)
        model, optimizer = train_torch.prepare(model, optimizer)
    x = torch.randn(8, 4)
    with train_torch.no_sync(), train_torch.autocast():
        loss = model(x).pow(2).mean()
    train_torch.backward(loss)
    norm = train_torch.clip_grad_norm_(1e-3)
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert norm > 1e-3 and total == pytest.approx(1e-3, rel=1e-3)  # clipped
    before = model.weight.detach().clone()
    train_torch.step()
    train_torch.zero_grad()
    assert not torch.equal(before, model.weight)
    state = train_torch.full_state_dict()
    assert set(state["models"][0]) == {"weight", "bias"}
    report({"done": True})


@pytest.mark.parametrize("backend", ["ddp", "fairscale"])
def test_step_helpers_call_the_backends_strategy(backend, tmp_path):
    result = TorchTrainer(
        helpers_loop,
        train_loop_config={"backend": backend},
        scaling_config={"num_workers": 0},
        run_config=RunConfig(storage_path=str(tmp_path), name=backend),
        backend=backend,
    ).fit()
    assert result.metrics == {"done": True}


def test_launch_parses_the_script_and_its_own_arguments(tmp_path):
    from polytrain.cli.launch_runner import exit_code, launch
    from polytrain.cli.main import build_parser

    args = build_parser().parse_args(
        ["launch", "-n", "4", "--max-restarts", "2", "train.py", "--epochs", "3", "-n", "9"]
    )
    assert (args.num_workers, args.max_restarts, args.script) == (4, 2, "train.py")
    assert args.script_args == ["--epochs", "3", "-n", "9"]  # the script's, untouched
    with pytest.raises(ConfigError, match="'missing.py' is not a file"):
        launch("missing.py")
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="-n >= 1.*got -n 0"):
        launch(str(script), num_workers=0)
    assert exit_code(RuntimeError("python s.py exited with code 3 on rank 1")) == 3
    assert exit_code(RuntimeError("worker died")) == 1


def test_local_mode_reports_reach_the_trackers(tmp_path):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = TorchTrainer(
        local_loop,
        train_loop_config={"steps": 3, "scratch": str(tmp_path / "scratch")},
        scaling_config={"num_workers": 0},
        run_config=RunConfig(
            storage_path=str(tmp_path), name="tracked", loggers=["csv", "tensorboard"]
        ),
    ).fit()
    # The CSV lies in the run's directory, one row per report at step = report number.
    with open(os.path.join(result.path, "metrics.csv")) as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["step"], row["epoch"]) for row in rows] == [("1", "0"), ("2", "0"), ("3", "0")]
    assert [float(row["loss"]) for row in rows] == pytest.approx([1, 1 / 2, 1 / 3])
    assert "config/steps: 3" in open(os.path.join(result.path, "hparams.yaml")).read()
    events = EventAccumulator(os.path.join(result.path, "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert [e.value for e in scalars] == pytest.approx([1, 1 / 2, 1 / 3])
