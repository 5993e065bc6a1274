"""The mesh benchmark's turns mode: the two jobs never train at once, and the ratios pair neighbours."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.parallel import turns


def test_sandwich_ratios_compare_each_polytrain_window_with_the_native_ones_around_it():
    native = [10.0, 2.0, 4.0, 6.0]
    polytrain = [99.0, 3.0, 5.0, 12.0]  # window 0 is warm-up
    assert turns.sandwich_ratios(native, polytrain) == [1.0, 1.0, 2.0]


def test_the_jobs_alternate_window_by_window_and_never_overlap(tmp_path):
    windows, spans, lock = 3, [], threading.Lock()

    def job(name: str) -> None:
        side = turns.Turns(tmp_path, name, windows)
        side.mark_ready()
        for window in range(windows):
            side.wait_for(side.turn_of(window), timeout_s=30)
            begun = time.monotonic()
            time.sleep(0.05)  # the window's steps
            with lock:
                spans.append((name, window, begun, time.monotonic()))
            side.hand_over(window, time.monotonic() - begun, steps=1)
        side.wait_for(side.end, timeout_s=30)

    threads = [threading.Thread(target=job, args=(name,)) for name in reversed(turns.JOBS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    order = [(name, window) for name, window, _, _ in sorted(spans, key=lambda s: s[2])]
    assert order == [(name, w) for w in range(windows) for name in turns.JOBS]
    ordered = sorted(spans, key=lambda s: s[2])
    assert all(a[3] <= b[2] for a, b in zip(ordered, ordered[1:], strict=False))
    for name in turns.JOBS:
        assert len(turns.read_windows(tmp_path, name)) == windows


def test_a_turn_that_never_comes_times_out_with_the_job_named(tmp_path):
    side = turns.Turns(tmp_path, "polytrain", windows=1)
    with pytest.raises(TimeoutError, match="polytrain: turn 1"):
        side.wait_for(1, timeout_s=0.1)


def test_an_unknown_job_is_refused(tmp_path):
    with pytest.raises(ValueError, match="job must be one of"):
        turns.Turns(tmp_path, "horovod", windows=1)


def test_plain_sgd_holds_no_optimizer_state_by_the_formula_and_unknown_optimizers_are_refused():
    from benchmarks.parallel import workload

    adamw = workload.formula_bytes("tiny", "fsdp4", "adamw")
    sgd = workload.formula_bytes("tiny", "fsdp4", "sgd")
    assert adamw["optimizer"] == 2 * adamw["params"] and sgd["optimizer"] == 0
    assert sgd["params"] == adamw["params"]
    with pytest.raises(ValueError, match="optimizer must be one of"):
        workload.make_optimizer([], "lamb")
