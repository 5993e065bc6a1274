"""Drained nodes without Ray: the watch's decisions, the stop agreement, the worker's gate."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.cluster.connect import placeable_outside
from polytrain.launchers.worker import STOP_HANDLER, WORKER_STATE, Worker
from polytrain.runs.policies.drain import DrainPolicy, LeaveNodes, StopRun
from polytrain.runs.stop_at_step import agree_on_stop, stop_target
from polytrain.runs.watch.drains import PREEMPTION, DrainWatch
from polytrain.trainer_api.options.configs import FailureConfig
from polytrain.trainer_api.torch.stopping import GatedSteps, StopGate, gate


def _placements(*nodes: tuple[str, str]) -> list[SimpleNamespace]:
    return [SimpleNamespace(node_id=nid, node_ip=ip) for nid, ip in nodes]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ DrainWatch
def test_a_draining_node_of_the_group_is_reported_once_with_its_ranks_and_deadline():
    draining: dict[str, int] = {}
    clock = _Clock()
    watch = DrainWatch(draining=lambda: draining, clock=clock)
    watch.watch(_placements(("a", "10.0.0.1"), ("a", "10.0.0.1"), ("b", "10.0.0.2")))
    assert watch.poll() is None
    deadline_ms = int((time.time() + 30) * 1000)
    draining.update({"b": deadline_ms, "elsewhere": 0})
    clock.now += 1.0
    decision = watch.poll()
    assert decision is not None
    assert decision.node_ids == ("b",) and decision.ranks == (2,)
    assert decision.reason == PREEMPTION
    assert decision.nodes[0].deadline_ms == deadline_ms
    assert 28 < decision.seconds_left() <= 30
    line = decision.describe()
    assert line.startswith("Node b (10.0.0.2) is draining (preemption, deadline in ")
    assert watch.draining == {"b", "elsewhere"}  # every draining node, for sizing restarts
    assert decision.describe(now_s=deadline_ms / 1000 + 1).endswith("(preemption, deadline passed)")
    clock.now += 1.0
    assert watch.poll() is None  # reported once


def test_no_deadline_and_nodes_without_workers():
    watch = DrainWatch(draining=lambda: {"a": 0, "b": 2**63 - 1, "z": 5})
    watch.watch(_placements(("a", "10.0.0.1"), ("b", "10.0.0.2")))
    decision = watch.poll()
    assert decision is not None and decision.node_ids == ("a", "b")
    assert decision.seconds_left() is None
    assert decision.describe() == (
        "Node a (10.0.0.1) is draining (preemption, no deadline); "
        "Node b (10.0.0.2) is draining (preemption, no deadline)"
    )


def test_several_nodes_come_earliest_deadline_first():
    watch = DrainWatch(draining=lambda: {"a": 0, "b": 2_000_000_000_000, "c": 1_000_000_000_000})
    watch.watch(_placements(("a", "1"), ("b", "2"), ("c", "3")))
    decision = watch.poll()
    assert decision is not None and decision.node_ids == ("c", "b", "a")
    assert decision.ranks == (0, 1, 2)


def test_the_watch_looks_at_most_once_per_interval_unless_forced():
    calls = []
    clock = _Clock()

    def draining() -> dict[str, int]:
        calls.append(clock.now)
        return {}

    watch = DrainWatch(draining=draining, interval_s=1.0, clock=clock)
    watch.watch(_placements(("a", "1")))
    watch.poll()
    clock.now += 0.25
    watch.poll()
    watch.poll(force=True)
    clock.now += 1.0
    watch.poll()
    assert calls == [100.0, 100.25, 101.25]


def test_a_failed_look_is_skipped_and_a_disabled_watch_never_looks():
    def broken() -> dict[str, int]:
        raise ConnectionError("GCS busy")

    watch = DrainWatch(draining=broken)
    watch.watch(_placements(("a", "1")))
    assert watch.poll() is None
    off = DrainWatch(enabled=False, draining=lambda: pytest.fail("looked"))
    off.watch(_placements(("a", "1")))
    assert off.poll() is None


def test_a_new_group_is_watched_on_its_own_nodes():
    draining = {"a": 0}
    watch = DrainWatch(draining=lambda: draining)
    watch.watch(_placements(("b", "2")))
    assert watch.poll(force=True) is None
    watch.watch(_placements(("a", "1")))
    assert watch.poll(force=True).node_ids == ("a",)


# ------------------------------------------------------------- stop agreement
def test_stop_target_is_the_next_step_boundary_past_the_furthest_rank():
    assert stop_target([0, 0]) == 1
    assert stop_target([3, 5]) == 6
    assert stop_target([3, 5], unit=4) == 12  # batch 5 is in step 2 (batches 5-8): after step 3
    assert stop_target([8], unit=4) == 12
    assert stop_target([3, 5], margin=0) == 5


class _Ranks:
    """Ranks answering proposals as :class:`StopGate` does, at fixed positions."""

    def __init__(self, taken: list[int], moves: list[int] | None = None, every: int = 0) -> None:
        self.taken = taken
        self.moves = list(moves or [])  # batches every rank moves on after each request
        self.every = every  # ... once those are used up
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: dict[str, Any]) -> list[dict[str, Any] | None]:
        self.requests.append(request)
        replies = []
        for taken in self.taken:
            target = request.get("target")
            ok = target is None or taken <= target
            replies.append({"ok": ok, "taken": taken})
        move = self.moves.pop(0) if self.moves else self.every
        self.taken = [t + move for t in self.taken]
        return replies


def test_agreement_on_the_first_proposal():
    ranks = _Ranks([4, 5])
    assert agree_on_stop(ranks) == 6
    assert ranks.requests == [{"target": None}, {"target": 6}, {"target": 6, "final": True}]


def test_a_rank_past_the_proposal_raises_the_target_for_everyone():
    ranks = _Ranks([4, 5], moves=[2])  # by the proposal of 6, the ranks are at 6 and 7
    target = agree_on_stop(ranks)
    assert target == 8
    assert ranks.requests[1:] == [{"target": 6}, {"target": 8}, {"target": 8, "final": True}]


def test_a_silent_rank_cancels_the_stop():
    def ask(request: dict[str, Any]) -> list[dict[str, Any] | None]:
        asked.append(request)
        return [{"ok": True, "taken": 0}, None]

    asked: list[dict[str, Any]] = []
    assert agree_on_stop(ask) is None
    assert asked[-1] == {"cancel": True}


def test_ranks_that_never_stand_still_give_up_after_max_rounds():
    ranks = _Ranks([0, 0], every=10)
    assert agree_on_stop(ranks, max_rounds=3) is None
    assert ranks.requests[-1] == {"cancel": True} and len(ranks.requests) == 5


# --------------------------------------------------------------- worker gate
class _Steps:
    """A StepIterator stand-in: ``n`` batches, ``num_steps`` and ``ends_epoch``."""

    def __init__(self, n: int, num_steps: int | None = None, end_epoch: bool = False) -> None:
        self.left, self.num_steps, self.taken, self.end_epoch = n, num_steps, 0, end_epoch
        self.cursor = SimpleNamespace(finish_call=lambda: self.left == 0)

    def __next__(self) -> int:
        if self.left == 0 or (self.num_steps is not None and self.taken >= self.num_steps):
            raise StopIteration
        self.left -= 1
        self.taken += 1
        return self.taken

    def __len__(self) -> int:
        return self.left

    def ends_epoch(self) -> bool:
        return self.left == 0 or self.end_epoch


def _run_rank(steps: GatedSteps, out: list[int], lockstep: threading.Barrier) -> None:
    for batch in steps:
        out.append(batch)
        lockstep.wait()  # a collective: no rank starts batch n+1 before all finished n
        time.sleep(0.002)


def test_ranks_in_lockstep_stop_after_the_same_batch_through_their_gates():
    gates = [StopGate(), StopGate()]
    out: list[list[int]] = [[], []]
    lockstep = threading.Barrier(2, timeout=10)
    steps = [GatedSteps(_Steps(10_000), g) for g in gates]
    for g in gates:
        g.begin(7)
    threads = [
        threading.Thread(target=_run_rank, args=(s, o, lockstep))
        for s, o in zip(steps, out, strict=True)
    ]
    for t in threads:
        t.start()
    time.sleep(0.05)
    target = agree_on_stop(lambda req: [g({**req, "call": 7}) for g in gates])
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert target is not None and out[0] == out[1] == list(range(1, target + 1))
    assert all(s.stopped for s in steps)
    assert gates[0].stopped_early
    # stopped inside the epoch: the epoch goes on at the next call
    assert not steps[0].ends_epoch()


def test_a_request_that_overtakes_its_call_applies_when_the_call_begins():
    stop_gate = StopGate()
    assert stop_gate({"call": 3, "target": 2, "final": True})["ok"]
    stop_gate.begin(3)
    steps = GatedSteps(_Steps(10), stop_gate)
    assert list(steps) == [1, 2]
    stop_gate.end()
    # a request for the call that ended gets its final count; an older call's is stale
    assert stop_gate({"call": 3, "target": None}) == {"ok": True, "taken": 2, "ended": True}
    assert stop_gate({"call": 1, "target": 0}).get("stale")


def test_a_rank_past_the_target_refuses_and_a_waiting_rank_moves_on_to_the_new_one():
    stop_gate = StopGate()
    stop_gate.begin(1)
    steps = GatedSteps(_Steps(10), stop_gate)
    assert [next(steps), next(steps), next(steps)] == [1, 2, 3]
    assert stop_gate({"call": 1, "target": 2}) == {"ok": False, "taken": 3}
    assert stop_gate({"call": 1, "target": 4})["ok"]
    got: list[int] = []
    runner = threading.Thread(target=lambda: got.extend(steps))
    runner.start()
    time.sleep(0.1)
    assert got == [4]  # waits at the proposal for the verdict
    stop_gate({"call": 1, "target": 6})
    time.sleep(0.1)
    stop_gate({"call": 1, "target": 6, "final": True})
    runner.join(5)
    assert got == [4, 5, 6]


def test_a_cancelled_stop_lets_the_call_run_to_its_end():
    stop_gate = StopGate()
    stop_gate.begin(1)
    steps = GatedSteps(_Steps(5), stop_gate)
    stop_gate({"call": 1, "target": 2})
    got: list[int] = []
    runner = threading.Thread(target=lambda: got.extend(steps))
    runner.start()
    time.sleep(0.1)
    stop_gate({"call": 1, "cancel": True})
    runner.join(5)
    assert got == [1, 2, 3, 4, 5]
    assert steps.ends_epoch()


def test_end_epoch_holds_only_when_the_call_ran_all_its_batches():
    early = StopGate()
    early.begin(1)
    early({"call": 1, "target": 2, "final": True})
    stopped = GatedSteps(_Steps(10, num_steps=4, end_epoch=True), early)
    assert list(stopped) == [1, 2] and not stopped.ends_epoch()
    full = StopGate()
    full.begin(1)
    full({"call": 1, "target": 4, "final": True})
    at_limit = GatedSteps(_Steps(10, num_steps=4, end_epoch=True), full)
    assert list(at_limit) == [1, 2, 3, 4] and at_limit.ends_epoch()


def test_the_worker_monitor_method_reaches_the_gate():
    WORKER_STATE.pop(STOP_HANDLER, None)
    try:
        assert Worker.stop_request(None, {"call": 1}) is None  # no gate: nothing to stop
        stop_gate = gate()
        assert gate() is stop_gate and WORKER_STATE[STOP_HANDLER] is stop_gate
        assert Worker.stop_request(None, {"call": 1, "target": None}) == {"ok": True, "taken": 0}
    finally:
        WORKER_STATE.pop(STOP_HANDLER, None)


# ------------------------------------------------------------ sizing, config
def test_placeable_outside_skips_draining_nodes_and_counts_per_node():
    free = {"a": {"CPU": 2.0}, "b": {"CPU": 3.0}, "c": {"CPU": 1.0, "GPU": 1.0}}
    assert placeable_outside({"CPU": 2}, [], free) == 2  # b's third CPU fits no bundle
    assert placeable_outside({"CPU": 2}, ["b"], free) == 1
    assert placeable_outside({"CPU": 1, "GPU": 1}, [], free) == 1


def test_max_drains_is_unlimited_by_default_and_checked():
    assert FailureConfig().max_drains is None
    assert FailureConfig(max_drains=0).max_drains == 0
    with pytest.raises(ConfigError, match="max_drains must be >= 0; got -1"):
        FailureConfig(max_drains=-1)
    with pytest.raises(ConfigTypeError, match="max_drains"):
        FailureConfig(max_drains="3")


def test_max_preemptions_still_sets_the_drain_limit_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="max_preemptions is now max_drains"):
        config = FailureConfig(max_preemptions=2)
    assert config.max_drains == 2
    with pytest.raises(ConfigError, match="set max_drains only"):
        FailureConfig(max_drains=1, max_preemptions=2)


def test_the_drain_policy_counts_and_stops_past_its_limit():
    unlimited = DrainPolicy(None)
    assert [unlimited.decide() for _ in range(3)] == [LeaveNodes(1), LeaveNodes(2), LeaveNodes(3)]
    limited = DrainPolicy(1, "RayStrategy max_drains")
    assert limited.decide() == LeaveNodes(1)
    assert limited.decide() == StopRun(2, 1)
    assert limited.describe_limit() == "RayStrategy max_drains=1"
    assert unlimited.describe_limit() == "failure_config max_drains=unlimited"


# ------------------------------------------------------- the trainer's limit
def test_a_drain_past_max_drains_checkpoints_then_stops_the_trainer(monkeypatch):
    from polytrain import TorchTrainer
    from polytrain.errors import DrainLimitError, PreemptedError, TrainerShutdownError
    from polytrain.runs.watch.drains import DrainEvent, DrainingNode
    from tests.helpers import DIGITS

    trainer = TorchTrainer(
        **DIGITS,
        config={"batch_size": 32},
        num_workers=0,
        failure_config={"max_retries": 0, "max_drains": 0},
    )
    assert not trainer.loop.drain_watch.enabled  # local mode: no cluster to watch
    trainer.train(num_steps=3)
    written = []
    monkeypatch.setattr(trainer, "_checkpoint_for_drain", lambda: written.append(1) or "/ck/x")
    trainer.loop.pending_drain = DrainEvent((DrainingNode("n1", "10.0.0.9", (0,), None),))
    with pytest.raises(DrainLimitError) as info:
        trainer._leave_drained_nodes()
    assert isinstance(info.value, PreemptedError)  # the former name still catches it
    assert written == [1] and info.value.checkpoint_path == "/ck/x"
    message = str(info.value)
    assert message.startswith("Node n1 (10.0.0.9) is draining (preemption, no deadline)")
    assert "drain 1, more than failure_config max_drains=0" in message
    assert "Checkpoint /ck/x holds epoch 0, batch 3" in message
    assert trainer.num_drains == 1 and trainer.num_restarts == 0
    with pytest.raises(TrainerShutdownError):
        trainer.train()
