"""The run loop without Ray: one loop, its hooks, its decisions carried out (local-mode groups)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.errors import (
    DrainLimitError,
    TerminatedError,
    TrainerShutdownError,
    WorkerDiedError,
    WorkerError,
)
from polytrain.launchers import ScalingConfig
from polytrain.runs.loop import RunLoop
from polytrain.runs.policies.drain import DrainPolicy
from polytrain.runs.policies.failure import FailurePolicy
from polytrain.runs.watch.drains import DrainEvent, DrainingNode
from polytrain.runs.workload import CallStoppedForDrain, DrainCheckpoint, Workload

NODE = DrainingNode("n" * 56, "10.0.0.5", (1,), None)


class _Recorder(Workload):
    """A front end that records every hook the run loop calls."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def context(self, world_size: int) -> WorkerContext:
        return WorkerContext.from_scaling(ScalingConfig(num_workers=0), world_size=world_size)

    def setup_workers(self, group: Any) -> None:
        self.events.append(f"setup {len(group)}")

    def started(self) -> None:
        self.events.append("started")

    def before_restart(self, planned: bool) -> None:
        self.events.append(f"before_restart planned={planned}")

    def restore(self) -> None:
        self.events.append("restore")

    def restart_source(self) -> str | None:
        return "checkpoint_000002"

    def after_failed_call(self, error: BaseException) -> None:
        self.events.append(f"failed {type(error).__name__}")


def _loop(
    workload: Workload, max_retries: int = 1, max_drains: int | None = None, **kwargs: Any
) -> RunLoop:
    return RunLoop(
        workload,
        Backend(),
        ScalingConfig(num_workers=0),  # local mode: the "group" is this process
        failure_policy=FailurePolicy(max_retries),
        drain_policy=DrainPolicy(max_drains),
        **kwargs,
    )


def _flaky(outcomes: list[Any]) -> Any:
    def call() -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return call


def test_a_call_starts_the_group_it_needs_and_returns_every_ranks_result():
    workload = _Recorder()
    loop = _loop(workload)
    assert loop.call(lambda x: x + 1, 41) == [42]
    assert workload.events == ["setup 1", "started"]
    loop.close()
    with pytest.raises(TrainerShutdownError, match="_Recorder is shut down; create a new one"):
        loop.call(lambda: None)


def test_a_lost_worker_restarts_the_group_and_restores_the_state_once_per_budget(caplog):
    workload = _Recorder()
    loop = _loop(workload, max_retries=1)
    died = WorkerDiedError("Worker rank 0 (pid 9 on 10.0.0.5) died: killed", rank=0)
    with caplog.at_level(logging.WARNING, logger="polytrain.runs"):
        assert loop.call(_flaky([died, "ok"])) == ["ok"]
    assert workload.events == [
        "setup 1",
        "started",
        "failed WorkerDiedError",
        "before_restart planned=False",  # the failed group is gone already
        "setup 1",
        "started",
        "restore",
    ]
    assert loop.num_restarts == 1
    assert (
        "Worker rank 0 died (pid 9 on 10.0.0.5: killed); restart 1 of 1 (failure_config "
        "max_retries) from checkpoint_000002." in caplog.messages
    )
    with caplog.at_level(logging.ERROR, logger="polytrain.runs"):
        with pytest.raises(WorkerDiedError):
            loop.call(_flaky([died]))  # the budget is spent: raised, the run closed
    assert loop.closed
    assert "no restart left (failure_config max_retries=1, 1 used)" in caplog.text


def test_a_user_error_is_never_retried_and_a_calls_own_budget_counts_its_restarts():
    loop = _loop(_Recorder(), max_retries=5)
    with pytest.raises(WorkerError):
        loop.call(_flaky([WorkerError("rank 0 raised ValueError", rank=0), "never"]))
    assert loop.closed and loop.num_restarts == 0
    died = WorkerDiedError("Worker rank 0 died: killed", rank=0)
    strict = _loop(_Recorder(), max_retries=5)
    with pytest.raises(WorkerDiedError):
        strict.call(_flaky([died, died, "late"]), max_retries=1)  # train(max_retries=1)
    assert strict.num_restarts == 1


def test_a_drain_is_counted_apart_and_the_group_moves_off_from_the_checkpoint(caplog):
    workload = _Recorder()
    loop = _loop(workload, max_retries=0)
    loop.start()
    loop.pending_drain = DrainEvent((NODE,))
    stop = DrainCheckpoint("/ck/checkpoint_000001.00000011", "epoch 1, batch 11", "Resume")
    with caplog.at_level(logging.WARNING, logger="polytrain.runs"):
        loop.leave_drained_nodes(stop)
    assert loop.num_drains == 1 and loop.num_restarts == 0 and loop.pending_drain is None
    assert workload.events[-3:] == ["setup 1", "started", "restore"]
    assert caplog.messages[0] == (
        f"Drain 1 (failure_config max_drains=unlimited) of node {NODE.node_id}: checkpoint "
        f"/ck/checkpoint_000001.00000011 holds epoch 1, batch 11 (no deadline)."
    )
    assert caplog.messages[1] == (
        "Continuing from /ck/checkpoint_000001.00000011 on 1 worker(s) off the drained node(s)."
    )


def test_one_drain_past_the_limit_stops_the_run_and_names_the_checkpoint():
    loop = _loop(_Recorder(), max_drains=0)
    loop.start()
    loop.pending_drain = DrainEvent((NODE,))
    stop = DrainCheckpoint("/ck/x", "report 8", "Resume from it (resume=True)")
    with pytest.raises(DrainLimitError) as info:
        loop.leave_drained_nodes(stop)
    assert info.value.checkpoint_path == "/ck/x" and loop.closed
    message = str(info.value)
    assert "that is drain 1, more than failure_config max_drains=0" in message
    assert (
        "Checkpoint /ck/x holds report 8: Resume from it (resume=True), or raise max_drains."
        in (message)
    )


def test_a_call_left_for_a_drain_runs_again_after_the_move():
    workload = _Recorder()
    loop = _loop(workload, max_retries=0)
    stopped = CallStoppedForDrain(
        DrainEvent((NODE,)), DrainCheckpoint(None, "the validate call", "Run it again")
    )
    assert loop.call(_flaky([stopped, "validated"])) == ["validated"]
    assert loop.num_drains == 1 and loop.num_restarts == 0


def test_the_termination_signal_checkpoints_at_the_boundary_then_raises():
    loop = _loop(_Recorder(), termination_enabled=True)
    loop.stop_if_terminated(lambda: "/never", "epoch 0, batch 3")  # no signal: nothing
    loop.termination.received = 15
    with pytest.raises(TerminatedError) as info:
        loop.stop_if_terminated(lambda: "/ck/here", "epoch 0, batch 3")
    assert info.value.checkpoint_path == "/ck/here" and info.value.exit_code == 143
    assert "Training stopped on SIGTERM: checkpoint /ck/here holds epoch 0, batch 3" in str(
        info.value
    )
    with pytest.raises(TerminatedError, match="the newest one is /ck/older"):
        loop.stop_if_terminated(lambda: None, "epoch 0, batch 3", newest=lambda: "/ck/older")
