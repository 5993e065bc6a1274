"""``CheckpointConfig`` keeps what Ray Train keeps: NaN below missing below numbers, nested attributes.

On the report board directly (no Ray): each case reports one checkpoint per step from a
single rank and reads which directories stay and what ``best`` (``Result.best_checkpoints``)
holds. The rule is Ray Train's (its checkpoint manager scores ``(not NaN, value)`` with a
missing metric as -inf and ties broken by report order, never deleting the latest).
"""

from __future__ import annotations

import math

import pytest

from polytrain.train.board import ReportBoard
from polytrain.train.config import CheckpointConfig


def _run(tmp_path, config: CheckpointConfig, reports: list[dict]) -> ReportBoard:
    board = ReportBoard(str(tmp_path), config)
    board.new_attempt(1)
    for index, metrics in enumerate(reports):
        (tmp_path / f"checkpoint_{index:06d}").mkdir()
        board.report(index, 0, metrics, True)
    return board


def _kept(tmp_path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoint_*"))


def test_a_nan_score_is_dropped_before_a_missing_one(tmp_path):
    # Ray: NaN < missing (-inf) < numbers. Ranked by (-inf, index) alike, the old rule
    # dropped the older of the two (the missing one) and kept the NaN.
    config = CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="score")
    board = _run(tmp_path, config, [{"x": 0}, {"score": math.nan}, {"score": 5}, {"score": 6}])
    assert _kept(tmp_path) == [0, 2, 3]
    assert [m.get("score") for _, m in board.best()] == [None, 5, 6]


@pytest.mark.parametrize(
    ("order", "kept", "best"),
    [
        # min: 0.5 is best, then 1.0; 2.0 is the latest (kept for restarts, not among the best)
        ("min", [0, 2, 3], [1.0, 0.5]),
        # max: 2.0 and 1.0 are the best two
        ("max", [0, 3], [1.0, 2.0]),
    ],
)
def test_num_to_keep_by_score_with_a_nan(tmp_path, order, kept, best):
    config = CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order=order
    )
    board = _run(tmp_path, config, [{"loss": v} for v in (1.0, math.nan, 0.5, 2.0)])
    assert _kept(tmp_path) == kept
    assert [m["loss"] for _, m in board.best()] == best
    assert board.latest_checkpoint().endswith("checkpoint_000003")


def test_the_latest_is_kept_until_a_newer_one_comes(tmp_path):
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score")
    board = _run(tmp_path, config, [{"score": 3.0}, {"score": 2.0}, {"score": 1.0}])
    assert _kept(tmp_path) == [0, 1, 2]  # 1.0 is the latest: not deleted yet
    (tmp_path / "checkpoint_000003").mkdir()
    board.report(3, 0, {"score": 0.0}, True)
    assert _kept(tmp_path) == [0, 1, 3]  # the previous latest goes, the new one stays


@pytest.mark.parametrize(
    "metrics",
    [
        {"nested": {"sub": {"attr": 5}}},
        {"nested": {"sub/attr": 5}},
        {"nested/sub": {"attr": 5}},
        {"nested/sub/attr": 5},
    ],
)
def test_a_nested_score_attribute(tmp_path, metrics):
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="nested/sub/attr")
    board = _run(tmp_path, config, [metrics, {"nested/sub/attr": 1}])
    assert [m for _, m in board.best()] == [metrics]  # 5 beats 1


def test_without_a_score_the_newest_are_kept(tmp_path):
    board = _run(tmp_path, CheckpointConfig(num_to_keep=2), [{"i": i} for i in range(5)])
    assert _kept(tmp_path) == [3, 4]
    assert [m["i"] for _, m in board.best()] == [3, 4]


def test_a_checkpoint_pending_validation_is_not_deleted(tmp_path):
    board = ReportBoard(str(tmp_path), CheckpointConfig(num_to_keep=1))
    board.new_attempt(1)
    for index in range(3):
        (tmp_path / f"checkpoint_{index:06d}").mkdir()
        board.report(index, 0, {"i": index}, True, validation=index == 0)
    assert _kept(tmp_path) == [0, 2]  # 0 waits for its validation; 1 went
    assert board.reported_checkpoints(2, validated=True) is None  # VALIDATED mode waits
    board.validation_done(0, {"val": 1.0}, "VALIDATED")
    assert _kept(tmp_path) == [2]
    assert [url.rsplit("/", 1)[1] for url, *_ in board.reported_checkpoints(2, True)] == [
        "checkpoint_000002"
    ]
