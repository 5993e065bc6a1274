"""``get_preemption_info()`` without Ray: the info object, the board's consistent answer, the stop.

The board hands a drain out from a report number no rank has made yet, so every
rank gets the same answer from the same ``report()`` call; the first step after
that which commits a checkpoint stops every rank there. The driver's side (tell the
loop once, stop past ``max_preemption_failures``, say so when a restart follows a
drain the loop did not checkpoint for) runs on a runner without a worker group. The
real drain on a simulated two-node cluster is tests/integration/test_function_api_drain.py.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import threading
from types import SimpleNamespace

import pytest

from polytrain.errors import ConfigError, ConfigTypeError, DrainLimitError, WorkerDiedError
from polytrain.launchers.worker import WORKER_STATE
from polytrain.runs.loop import RunLoop
from polytrain.runs.policies.drain import DrainPolicy
from polytrain.runs.policies.failure import FailurePolicy
from polytrain.runs.watch.drains import DrainEvent, DrainingNode
from polytrain.train import (
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    PreemptionInfo,
    RunConfig,
    SessionMisuseError,
    TrainContext,
    get_preemption_info,
    report,
    worker_entry,
)
from polytrain.train import session as train_session
from polytrain.train.board import ReportBoard
from polytrain.train.preemption import LoopStopped
from polytrain.train.trainer import _LoopRunner

NOW_S = 1_700_000_000.0
NODE_A = DrainingNode("a" * 56, "10.0.0.7", (2, 3), int((NOW_S + 87) * 1000))
NODE_B = DrainingNode("b" * 56, "10.0.0.8", (0,), int((NOW_S + 30) * 1000))
NO_DEADLINE = DrainingNode("c" * 56, "10.0.0.9", (1,), None)


# ------------------------------------------------------------------ outside a loop
def test_outside_a_loop_get_preemption_info_says_where_to_call_it():
    with pytest.raises(
        SessionMisuseError,
        match=r"get_preemption_info\(\) was called outside a training loop.*train_loop_per_worker",
    ):
        get_preemption_info()


# ------------------------------------------------------------------ the info object
def test_the_info_names_the_node_its_ip_the_reason_the_deadline_and_the_ranks():
    info = PreemptionInfo.from_event(DrainEvent((NODE_A,)))
    assert (info.node_id, info.node_ip, info.reason) == (NODE_A.node_id, "10.0.0.7", "preemption")
    assert info.ranks == (2, 3) and info.deadline_ms == NODE_A.deadline_ms
    assert info.deadline == datetime.datetime.fromtimestamp(NOW_S + 87, tz=datetime.timezone.utc)
    assert info.seconds_left(now_s=NOW_S) == pytest.approx(87)
    assert info.seconds_left(now_s=NOW_S + 100) == pytest.approx(-13)
    assert info.describe(now_s=NOW_S) == (
        f"Node {NODE_A.node_id} (10.0.0.7) is draining (preemption, deadline in 87 s)"
    )
    # Ray Train's names
    assert info.preempted_node_to_ranks == {NODE_A.node_id: [2, 3]}
    assert info.preempted_node_ids == [NODE_A.node_id] and info.preempted_ranks == [2, 3]
    # the same value on every rank: it travels by pickle and compares equal
    assert pickle.loads(pickle.dumps(info)) == info
    with pytest.raises(AttributeError):
        info.node_id = "x"  # frozen


def test_several_draining_nodes_earliest_deadline_first_ranks_of_all():
    first = PreemptionInfo.from_event(DrainEvent((NODE_A,)))
    both = PreemptionInfo.from_event(DrainEvent((NODE_B, NO_DEADLINE)), previous=first)
    assert both.node_id == NODE_B.node_id and both.node_ip == "10.0.0.8"  # deadline in 30 s
    assert both.deadline_ms == NODE_B.deadline_ms
    assert [n.node_id for n in both.nodes] == [NODE_B.node_id, NODE_A.node_id, NO_DEADLINE.node_id]
    assert both.ranks == (0, 1, 2, 3)
    assert both.preempted_node_to_ranks == {
        NODE_A.node_id: [2, 3],
        NODE_B.node_id: [0],
        NO_DEADLINE.node_id: [1],
    }


def test_a_drain_without_deadline_has_none():
    info = PreemptionInfo.from_nodes([NO_DEADLINE], reason="idle termination")
    assert info.deadline_ms is None and info.deadline is None and info.seconds_left() is None
    assert info.describe().endswith("is draining (idle termination, no deadline)")


def test_the_info_refuses_an_unknown_reason_and_no_node():
    with pytest.raises(ConfigError, match=r"reason='spot'.*\('preemption', 'idle termination'\)"):
        PreemptionInfo.from_nodes([NODE_A], reason="spot")
    with pytest.raises(ConfigError, match="at least one draining node; got none"):
        PreemptionInfo.from_nodes([])


def test_max_preemption_failures_maps_onto_the_creator_apis_max_drains():
    assert FailureConfig().to_polytrain().max_drains is None  # -1: no limit
    assert FailureConfig(max_preemption_failures=2).to_polytrain().max_drains == 2
    assert FailureConfig(max_preemption_failures=0).to_polytrain().max_drains == 0
    assert RunConfig(failure_config={"max_preemption_failures": 1}).failure_config == (
        FailureConfig(max_preemption_failures=1)
    )
    with pytest.raises(ConfigError, match=r"max_preemption_failures=-2\) must be an int: -1"):
        FailureConfig(max_preemption_failures=-2)
    with pytest.raises(ConfigTypeError, match=r"max_preemption_failures='1'\)"):
        FailureConfig(max_preemption_failures="1")


# ------------------------------------------------------------------ the board
def test_every_rank_gets_the_same_answer_at_the_same_report(tmp_path):
    board = ReportBoard(str(tmp_path), CheckpointConfig())
    assert board.new_attempt(2) == 0
    info = PreemptionInfo.from_nodes([NODE_A])
    answers: dict[tuple[int, int], object] = {}
    board.report(0, 0, {}, False)
    board.report(0, 1, None, False)
    board.report(1, 0, {}, False)  # rank 0 is one report ahead of rank 1 ...
    assert board.announce_preemption(info) == 2  # ... so the drain is told from report 2 on
    for index, rank in [(1, 1), (2, 0), (2, 1), (3, 1), (3, 0)]:
        answers[index, rank] = board.report(index, rank, {} if rank == 0 else None, False)[0]
    assert answers[1, 1] is None  # rank 0 had report 1's answer (None): rank 1 gets it too
    assert answers[2, 0] == answers[2, 1] == info
    assert answers[3, 0] == answers[3, 1] == info
    # no checkpoint at the announced steps: nobody stops
    assert board.step_done(2) is False and board.step_done(3) is False
    # a restarted group runs off the node: nothing announced any more
    assert board.new_attempt(1) == 4
    assert board.report(4, 0, {}, False) == (None, None)


def test_the_first_announced_step_with_a_checkpoint_is_where_every_rank_stops(tmp_path):
    board = ReportBoard(str(tmp_path), CheckpointConfig())
    board.new_attempt(2)
    info = PreemptionInfo.from_nodes([NODE_A])
    assert board.announce_preemption(info) == 0
    (tmp_path / "checkpoint_000000").mkdir()
    # rank 1 reports first, without a checkpoint: it cannot know yet whether to stop
    assert board.report(0, 1, None, False) == (info, None)
    assert board.step_done(0) is None
    # rank 0 completes the step with the checkpoint: committed, so both stop here
    assert board.report(0, 0, {"step": 0}, True) == (info, True)
    assert board.step_done(0) is True
    assert (tmp_path / "checkpoint_000000" / "COMMITTED").exists()


# ------------------------------------------------------------------ a loop in this process
class _Strategy:
    def worker_scope(self, ctx):
        return contextlib.nullcontext()


def _hold_rank0(monkeypatch, board, run_dir, fn) -> None:
    """What setup_session leaves in a worker: rank 0 of 2, the loop ``fn``, this board."""
    context = TrainContext(
        world_rank=0,
        world_size=2,
        local_rank=0,
        local_world_size=2,
        node_rank=0,
        experiment_name="drain",
    )
    session = train_session.Session(
        context=context,
        worker_context=SimpleNamespace(),
        board=board,
        run_url=str(run_dir),
        strategy=_Strategy(),
    )
    spec = SimpleNamespace(fn=fn, takes_config=False, config={})
    monkeypatch.setitem(WORKER_STATE, worker_entry._SPEC, (spec, session))


def test_report_ends_the_loop_at_the_checkpoint_after_a_drain(tmp_path, monkeypatch):
    """Rank 0's loop runs here; rank 1's reports go straight to the board."""
    run_dir = tmp_path / "run"
    board = ReportBoard(str(run_dir), CheckpointConfig())
    board.new_attempt(2)
    info = PreemptionInfo.from_nodes([NODE_A])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "model.pt").write_bytes(b"weights")
    seen: list[tuple[int, PreemptionInfo | None]] = []

    def loop():
        for step in range(10):
            if step == 2:
                assert board.announce_preemption(info) == 2  # the driver, between two reports
            answer = get_preemption_info()
            seen.append((step, answer))
            if answer is None:
                board.report(step, 1, None, False)  # rank 1 first: rank 0 completes the step
                report({"step": step})
            else:
                # rank 1 after rank 0: rank 0 waits until it knows the step committed
                threading.Timer(0.05, board.report, args=(step, 1, None, False)).start()
                report({"step": step}, checkpoint=Checkpoint.from_directory(scratch))
        raise AssertionError("report() returned from the checkpoint that follows a drain")

    _hold_rank0(monkeypatch, board, run_dir, loop)
    monkeypatch.setattr(train_session, "_STEP_WAIT_S", (0.001, 0.01))
    assert worker_entry.run_loop(0, None) == LoopStopped(3)
    # report 2 is the first to answer with the drain: the loop sees it at step 3
    assert [(step, answer is not None) for step, answer in seen] == [
        (0, False),
        (1, False),
        (2, False),
        (3, True),
    ]
    assert seen[3][1] == info
    assert (run_dir / "checkpoint_000003" / "COMMITTED").exists()
    assert (run_dir / "checkpoint_000003" / "model.pt").read_bytes() == b"weights"
    with pytest.raises(SessionMisuseError):
        get_preemption_info()  # the loop has ended


def test_a_loop_that_returns_after_a_drain_is_done(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    board = ReportBoard(str(run_dir), CheckpointConfig())
    board.new_attempt(2)
    info = PreemptionInfo.from_nodes([NODE_A])
    board.announce_preemption(info)

    def loop():
        board.report(0, 1, None, False)
        report({"step": 0})  # no checkpoint: the loop goes on, and returns
        assert get_preemption_info() == info

    _hold_rank0(monkeypatch, board, run_dir, loop)
    assert worker_entry.run_loop(0, None) is None


def test_a_loop_that_swallows_the_stop_still_ends_there(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    board = ReportBoard(str(run_dir), CheckpointConfig())
    board.new_attempt(2)
    board.announce_preemption(PreemptionInfo.from_nodes([NODE_A]))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    caught: list[str] = []

    def loop():
        for step in range(3):
            board.report(step, 1, None, False)
            try:
                report({"step": step}, checkpoint=Checkpoint.from_directory(scratch))
            except Exception as exc:  # a loop that swallows everything
                caught.append(str(exc))
        return "done"

    _hold_rank0(monkeypatch, board, run_dir, loop)
    assert worker_entry.run_loop(0, None) == LoopStopped(0)
    assert len(caught) == 3 and all("stops at report 0" in text for text in caught)
    assert "re-raise it" in caught[0]
    assert [entry["step"] for entry in board.snapshot()["history"]] == [0]  # no report after


# ------------------------------------------------------------------ the driver's decisions
class _Runner(_LoopRunner):
    """The driver's drain handling on a real run loop without a worker group: calls are recorded."""

    def __init__(self, max_failures: int = 0, max_preemption_failures: int = -1) -> None:
        failure = FailureConfig(
            max_failures=max_failures, max_preemption_failures=max_preemption_failures
        )
        self.calls: list[tuple] = []
        self.owner = SimpleNamespace(
            _board_call=self._board_call,
            run_config=SimpleNamespace(failure_config=failure),
            attempt_args=lambda: (0, None),
        )
        self.failure = failure.to_polytrain()
        self._announced = None
        self.loop = RunLoop(
            self,
            SimpleNamespace(),
            SimpleNamespace(num_workers=1, local_mode=False),
            failure_policy=FailurePolicy(
                self.failure.max_retries, option="FailureConfig max_failures"
            ),
            drain_policy=DrainPolicy(
                self.failure.max_drains, "FailureConfig max_preemption_failures"
            ),
            watch_drains=False,
        )

    def _board_call(self, method, *args):
        self.calls.append((method, *args))
        return {"announce_preemption": 7, "latest_checkpoint": "/runs/r/checkpoint_000008"}[method]


def test_the_driver_tells_the_loop_once_per_drain_through_the_board(caplog):
    runner = _Runner()
    event = DrainEvent((NODE_A,))
    with caplog.at_level(logging.WARNING, logger="polytrain.train.trainer"):
        runner.on_drain(event, new=True)
        runner.on_drain(event, new=False)  # still pending: nothing posted again
    info = PreemptionInfo.from_nodes([NODE_A])
    assert runner._announced == info
    assert [c for c in runner.calls if c[0] == "announce_preemption"] == [
        ("announce_preemption", info)
    ]
    (line,) = caplog.messages
    assert line.startswith(f"Node {NODE_A.node_id} (10.0.0.7) is draining (preemption, ")
    assert "from its next report() on (report 7 of the run; ranks 2, 3 on the node)" in line
    assert "latest checkpoint (/runs/r/checkpoint_000008)" in line


def test_a_stop_past_max_preemption_failures_ends_the_run_with_the_checkpoint(caplog, monkeypatch):
    runner = _Runner(max_preemption_failures=0)
    runner._announced = PreemptionInfo.from_nodes([NODE_A])
    runner.loop.pending_drain = DrainEvent((NODE_A,))
    monkeypatch.setattr(runner.loop, "call", lambda *a, **k: [LoopStopped(8), LoopStopped(8)])
    with caplog.at_level(logging.WARNING, logger="polytrain.runs.loop"):
        with pytest.raises(DrainLimitError, match="max_preemption_failures=0") as raised:
            runner.run()
    assert raised.value.checkpoint_path == "/runs/r/checkpoint_000008"
    assert runner.loop.closed and runner.loop.num_drains == 1
    assert "get_checkpoint()" in str(raised.value)
    assert caplog.messages[0].startswith(
        f"Drain 1 (FailureConfig max_preemption_failures=0) of node {NODE_A.node_id}: "
        f"checkpoint /runs/r/checkpoint_000008 holds report 8 ("
    )


def test_a_restart_after_a_drain_the_loop_did_not_checkpoint_for_says_so(caplog, monkeypatch):
    runner = _Runner(max_failures=2)
    runner._announced = PreemptionInfo.from_nodes([NODE_A])
    runner.loop.pending_drain = DrainEvent((NODE_A,))
    outcomes = [WorkerDiedError("Worker rank 2 died: node gone", rank=2), ["done"]]

    def call_once(*args, **kwargs):
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    restarted: list[str] = []
    monkeypatch.setattr(runner.loop, "call_once", call_once)
    monkeypatch.setattr(runner.loop, "restart", lambda n=None: restarted.append("restart"))
    with caplog.at_level(logging.WARNING):
        assert runner.loop.call(lambda: None) == ["done"]
    assert restarted == ["restart"] and runner.loop.pending_drain is None
    assert runner.loop.num_restarts == 1
    drained, restart = caplog.messages
    assert drained.startswith(f"Node {NODE_A.node_id} (10.0.0.7) is draining")
    assert "the group lost a worker before it stopped there (the node is gone)" in drained
    assert "(FailureConfig max_failures=2)" in drained
    assert restart == (
        "Worker rank 2 died (node gone); restart 1 of 2 (FailureConfig max_failures) from "
        "/runs/r/checkpoint_000008."
    )
