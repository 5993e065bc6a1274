"""Metric reduction across workers."""

from __future__ import annotations

import pytest

from polytrain.trainer_api.results import reduce_worker_stats


def test_weighted_by_sample_count():
    stats = [
        {"loss": 1.0, "num_samples": 30, "epoch_time_s": 2.0, "num_steps": 3, "note": "rank0"},
        {"loss": 3.0, "num_samples": 10, "epoch_time_s": 4.0, "num_steps": 3, "note": "rank1"},
    ]
    reduced = reduce_worker_stats(stats)
    assert reduced["loss"] == pytest.approx(1.5)
    assert reduced["num_samples"] == 40
    assert reduced["epoch_time_s"] == 4.0
    assert reduced["samples_per_s"] == pytest.approx(10.0)
    assert reduced["num_steps"] == 3
    assert reduced["note"] == "rank0"


def test_metrics_without_sample_counts_are_plain_means():
    assert reduce_worker_stats([{"acc": 0.5}, {"acc": 1.0}])["acc"] == pytest.approx(0.75)


def test_metric_reported_by_some_workers_only():
    reduced = reduce_worker_stats([{"x": 2.0, "num_samples": 1}, {"num_samples": 3}])
    assert reduced["x"] == 2.0 and reduced["num_samples"] == 4


def test_empty_and_none_entries():
    assert reduce_worker_stats([]) == {}
    assert reduce_worker_stats([None, {"loss": 1.0, "num_samples": 2}])["loss"] == 1.0


def test_bools_are_not_averaged():
    assert reduce_worker_stats([{"flag": True}, {"flag": False}])["flag"] is True
