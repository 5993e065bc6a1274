"""The trainer's recovery policies, checkpoint manager and group factory, without Ray."""

from __future__ import annotations

import time
from typing import Any

import pytest

from polytrain.checkpoint.single_file import FORMAT, VERSION
from polytrain.errors import (
    InsufficientResourcesError,
    WorkerDiedError,
    WorkerError,
    WorkerHangError,
)
from polytrain.launchers import LocalWorkerGroup, ScalingConfig, WorkerGroup, make_group
from polytrain.launchers.local import _Done
from polytrain.runs.policies.failure import FailureDecision, FailurePolicy
from polytrain.runs.policies.scaling import ScalingPolicy
from polytrain.runs.watch.hang import HangWatchdog
from polytrain.runs.watch.progress import ProgressReporter
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.options.configs import CheckpointConfig


def test_failure_policy_retries_lost_and_hung_workers_within_the_budget():
    policy = FailurePolicy(max_retries=2)
    died = WorkerDiedError("rank 1 died", rank=1)
    assert policy.should_retry(died)
    policy.record_restart(died)
    assert policy.should_retry(WorkerHangError("stuck", rank=0))
    policy.record_restart(died)
    assert policy.num_restarts == 2
    assert not policy.should_retry(died)  # budget spent


def test_failure_config_retries_lost_workers_three_times_by_default():
    from polytrain.trainer_api.options.configs import FailureConfig

    assert FailureConfig().max_retries == 3  # RaySGD's default
    died = WorkerDiedError("rank 1 died", rank=1)
    policy = FailurePolicy(FailureConfig().max_retries)
    for _ in range(3):
        assert policy.should_retry(died)
        policy.record_restart(died)
    assert not policy.should_retry(died)


def test_a_call_budget_overrides_the_trainers_budget():
    died = WorkerDiedError("rank 1 died", rank=1)
    spent = FailurePolicy(max_retries=1)
    spent.record_restart(died)
    assert not spent.should_retry(died)
    assert spent.should_retry(died, call_max_retries=2, call_restarts=1)  # train(max_retries=2)
    assert not spent.should_retry(died, call_max_retries=2, call_restarts=2)
    assert not FailurePolicy(max_retries=3).should_retry(died, call_max_retries=0)
    user_error = WorkerError("user code raised", rank=0)
    assert not FailurePolicy(max_retries=3).should_retry(user_error, call_max_retries=5)


@pytest.mark.parametrize(
    "error",
    [WorkerError("user code raised", rank=0), ValueError("bad"), KeyboardInterrupt()],
)
def test_failure_policy_never_retries_user_errors_or_interrupts(error):
    assert not FailurePolicy(max_retries=5).should_retry(error)


def test_the_failure_policy_decides_as_data_and_a_launcher_may_retry_any_worker_error():
    died = WorkerDiedError("rank 1 died", rank=1)
    user_error = WorkerError("exited with code 3", rank=0)
    assert FailurePolicy(max_retries=1).decide(died) is FailureDecision.RETRY
    assert FailurePolicy(max_retries=1).decide(user_error) is FailureDecision.RAISE
    # polytrain launch: any failed rank restarts the script, as torchrun --max-restarts does.
    script = FailurePolicy(1, retryable=(WorkerError,), option="--max-restarts")
    assert script.decide(user_error) is FailureDecision.RETRY
    script.record_restart(user_error)
    assert script.decide(user_error) is FailureDecision.RAISE
    assert FailurePolicy(2**31 - 1).describe_limit() == "unlimited"


def test_scaling_policy_without_min_workers_always_restarts_in_full():
    policy = ScalingPolicy(ScalingConfig(num_workers=3), placeable=lambda: 0)
    assert not policy.elastic
    assert policy.restart_size() == 3
    assert not policy.should_grow(3)


def test_scaling_policy_restarts_with_what_fits_and_grows_back():
    free = {"workers": 2}
    scaling = ScalingConfig(num_workers=4, min_workers=2, start_timeout_s=5)
    policy = ScalingPolicy(scaling, placeable=lambda: free["workers"])
    assert policy.restart_size() == 2
    free["workers"] = 1
    assert not policy.should_grow(2)  # 2 running + 1 free < 4
    free["workers"] = 2
    assert policy.should_grow(2)
    assert not policy.should_grow(4)


def test_a_shrunk_group_asks_the_autoscaler_for_the_missing_nodes_and_withdraws_the_ask():
    free, asks = {"workers": 0}, []
    scaling = ScalingConfig(num_workers=4, min_workers=2)

    def request(workers: int) -> bool:
        asks.append(workers)
        return True

    policy = ScalingPolicy(scaling, placeable=lambda: free["workers"], request=request)
    assert not policy.should_grow(2)
    assert not policy.should_grow(2)  # the standing ask is not repeated
    assert asks == [4]
    free["workers"] = 2  # the autoscaler added a node
    assert policy.should_grow(2)
    assert not policy.should_grow(4)  # at full size: the ask is withdrawn
    assert asks == [4, 0]
    policy.release()  # nothing left to withdraw
    assert asks == [4, 0]


def test_without_an_autoscaler_nothing_is_asked_again():
    asks = []
    policy = ScalingPolicy(
        ScalingConfig(num_workers=4, min_workers=2),
        placeable=lambda: 0,
        request=lambda n: asks.append(n) or False,
    )
    assert not policy.should_grow(2) and not policy.should_grow(3)
    policy.release()
    assert asks == [4]


def test_scaling_policy_gives_up_below_min_workers():
    scaling = ScalingConfig(num_workers=4, min_workers=3, start_timeout_s=0)
    with pytest.raises(InsufficientResourcesError, match="fewer than min_workers=3"):
        ScalingPolicy(scaling, placeable=lambda: 1).restart_size()


class _FrozenGroup(WorkerGroup):
    """Two "workers" whose progress never moves; rank 1 sits in user code."""

    env_vars: dict[str, str] = {}
    metadata: list = []
    rank_infos: list = []
    device_indices = [-1, -1]

    def __init__(self) -> None:
        self.progress = [
            {"phase": "train", "epoch": 0, "step": 4},
            {"phase": "train", "epoch": 0, "step": 3},
        ]
        self.stacks = [
            'File "/x/site-packages/torch/distributed.py", line 1, in all_reduce',
            'File "/home/me/train.py", line 7, in train_batch',
        ]

    def start(self) -> None:
        pass

    def __len__(self) -> int:
        return 2

    def execute_async(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError

    def execute_single_async(self, rank: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def get(self, refs, ranks=None, on_poll=None, poll_interval_s=0.5) -> list[Any]:
        return [ref.value for ref in refs]

    def execute_best_effort(self, fn: Any, timeout_s: float = 5.0) -> None:
        pass

    def monitor(self, method: str, timeout_s: float = 10.0) -> list[Any]:
        return list(getattr(self, method))

    def monitor_single_async(self, rank: int, method: str) -> Any:
        return _Done(self.monitor(method)[rank])

    def poll(self, ref: Any) -> tuple[bool, Any]:
        return True, ref.value

    def shutdown(self) -> None:
        pass


def test_hang_watchdog_names_the_stuck_rank_and_carries_every_stack():
    watchdog = HangWatchdog(_FrozenGroup(), timeout_s=0.2)
    watchdog.poll()
    watchdog.poll()  # progress read once: the clock starts from here
    time.sleep(0.3)
    with pytest.raises(WorkerHangError) as info:
        watchdog.poll()
    assert info.value.rank == 1
    assert 'Stuck: rank 1 (step 3, at File "/home/me/train.py"' in str(info.value)
    assert "--- rank 0 ---" in info.value.remote_traceback


class _StoppedRankGroup(_FrozenGroup):
    """Rank 1's process is stopped (SIGSTOP): its monitor calls never come back."""

    def monitor_single_async(self, rank: int, method: str) -> Any:
        return None if rank == 1 else _Done(self.monitor(method)[rank])

    def poll(self, ref: Any) -> tuple[bool, Any]:
        return (False, None) if ref is None else (True, ref.value)


def test_hang_watchdog_blames_a_stopped_process_at_once_and_says_so(monkeypatch):
    from polytrain.runs.watch import hang as watchdog_module

    monkeypatch.setattr(watchdog_module, "SILENT_AFTER_S", 0.1)
    monkeypatch.setattr(watchdog_module, "REPORT_WAIT_S", 30.0)
    group = _StoppedRankGroup()
    group.progress[0]["step"] = 2  # the stopped rank is not the one furthest behind
    watchdog = HangWatchdog(group, timeout_s=0.2)
    watchdog.poll()  # asks; rank 1 never answers
    time.sleep(0.3)
    started = time.monotonic()
    with pytest.raises(WorkerHangError) as info:
        watchdog.poll()
    # Known silent from its unanswered probe: the report does not wait REPORT_WAIT_S for it.
    assert time.monotonic() - started < 5.0
    assert info.value.rank == 1
    message = str(info.value)
    assert "Stuck: rank 1 (no answer: its process is stopped or frozen)" in message
    assert "at )" not in message
    assert "rank 0: phase train, epoch 0, step 2, stuck at File" in message
    assert (
        "--- rank 1 ---\nno answer: its process is stopped or frozen" in info.value.remote_traceback
    )


def test_hang_watchdog_is_quiet_while_progress_moves():
    group = _FrozenGroup()
    watchdog = HangWatchdog(group, timeout_s=0.2)
    for step in range(5, 10):
        group.progress[1] = {"phase": "train", "epoch": 0, "step": step}
        watchdog.poll()
        time.sleep(0.1)


def test_progress_reporter_follows_rank_0():
    group = make_group(ScalingConfig(num_workers=0))
    assert isinstance(group, LocalWorkerGroup)
    group.start()
    try:
        reporter = ProgressReporter(group, "epoch 0")
        reporter.poll()
        reporter.poll()
        reporter.close({"num_steps": 3, "loss": 0.5})
    finally:
        group.shutdown()


def _state(epoch: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "framework": "torch", "epoch": epoch,
            "models": [{}]}  # fmt: skip


def test_checkpoint_manager_writes_and_prunes_epoch_checkpoints(tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(checkpoint_dir=str(tmp_path), num_to_keep=2), keep_latest=True
    )
    paths = [manager.remember(_state(epoch)) for epoch in (1, 2, 3)]
    assert paths[-1] == str(tmp_path / "checkpoint_epoch_000003.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_epoch_000002.pt",
        "checkpoint_epoch_000003.pt",
    ]
    assert manager.latest["epoch"] == 3


def test_checkpoint_manager_keeps_loaded_states_only_when_recovery_needs_them():
    in_memory = CheckpointManager(CheckpointConfig(), keep_latest=True)
    assert in_memory.remember(_state(1)) is None  # no checkpoint_dir: memory only
    in_memory.loaded(_state(7))
    assert in_memory.latest["epoch"] == 7
    off = CheckpointManager(CheckpointConfig(), keep_latest=False)
    off.loaded(_state(7))
    assert off.latest is None
