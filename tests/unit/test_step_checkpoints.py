"""Mid-epoch checkpoint planning and the stats of a call cut into pieces (issue 13, point 4)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.runs.watch.termination import TerminationWatch
from polytrain.trainer_api.checkpointing.step_plans import PROBE_STEPS, StepCheckpointPlan
from polytrain.trainer_api.options.configs import CheckpointConfig
from polytrain.trainer_api.results import combine_call_stats
from polytrain.trainer_api.torch.trainer import TorchTrainer


def test_every_n_steps_cuts_calls_where_a_checkpoint_is_due():
    plan = StepCheckpointPlan(every_n_steps=5, every_s=None)
    assert plan.next_piece(None) == (5, True)
    assert plan.next_piece(3) == (3, False)  # the call ends before the checkpoint
    plan.record(3, 1.0, checkpointed=False)
    assert plan.next_piece(None) == (2, True)  # counted across calls
    plan.record(2, 1.0, checkpointed=True)
    assert plan.next_piece(7) == (5, True)


def test_every_s_turns_time_into_batches_with_the_measured_rate():
    now = {"t": 0.0}
    plan = StepCheckpointPlan(every_n_steps=None, every_s=10.0, clock=lambda: now["t"])
    assert plan.next_piece(None) == (PROBE_STEPS, False)  # measures the rate first
    now["t"] = 2.0
    plan.record(PROBE_STEPS, 2.0, checkpointed=False)  # 4 batches/s, 8 s left
    assert plan.next_piece(None) == (32, True)


def test_a_call_in_pieces_trains_what_one_call_would_and_reports_it_once():
    plan = StepCheckpointPlan(every_n_steps=4, every_s=None)
    calls = []

    def once(steps, ends, due):
        calls.append((steps, ends, due))
        done = sum(c[0] for c in calls) >= 10
        stats = {"epoch": 0, "loss": float(len(calls)), "num_samples": 32 * steps,
                 "num_steps": steps, "epoch_time_s": 1.0, "peak_memory_mb": 10.0 * len(calls)}  # fmt: skip
        return stats, [stats], due, done

    # The trainer's own loop over the plan (no trainer needed: it reads the plan and the
    # termination watch only).
    trainer = SimpleNamespace(_step_plan=plan, termination=TerminationWatch(enabled=False))
    stats, results = TorchTrainer._train_in_pieces(trainer, once, num_steps=10, end_epoch=True)
    assert calls == [(4, False, True), (4, False, True), (2, True, False)]
    assert [r["num_steps"] for r in results] == [2]  # the last piece's per-worker results
    assert (stats["num_steps"], stats["num_samples"], stats["epoch_time_s"]) == (10, 320, 3.0)
    assert stats["loss"] == pytest.approx((1 * 4 + 2 * 4 + 3 * 2) / 10)  # sample-weighted
    assert stats["peak_memory_mb"] == 30.0 and stats["samples_per_s"] == pytest.approx(320 / 3)
    assert plan.steps_since == 2


def test_combining_one_piece_changes_nothing():
    stats = {"epoch": 2, "loss": 0.5, "num_samples": 64}
    assert combine_call_stats([stats]) is stats


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"every_n_steps": 0}, ConfigError, "every_n_steps must be >= 1"),
        ({"every_n_steps": 2.5}, ConfigTypeError, "every_n_steps must be an int"),
        ({"every_s": -1}, ConfigError, "every_s must be a number"),
    ],
)
def test_bad_intervals_are_refused_naming_the_value(options, error, words):
    with pytest.raises(error, match=words):
        CheckpointConfig(**options)
