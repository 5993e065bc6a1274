"""Which pooled group serves a request of another world size (no Ray: the choice alone)."""

from __future__ import annotations

import dataclasses

import pytest

from polytrain.launchers.pool.warm_pool import IdleGroup, PoolKey, WorkerPool

KEY = PoolKey(bundle=(("CPU", 1.0),), num_workers=2, strategy="PACK", scope="own", session="s/1")


def _idle(size: int, **changes) -> IdleGroup:
    key = dataclasses.replace(KEY, num_workers=size, **changes)
    return IdleGroup(key, [object()] * size, [None] * size, object(), True)


def _pool(*groups: IdleGroup) -> WorkerPool:
    pool = WorkerPool()
    pool._idle.extend(groups)  # no put(): it would start the reaper, which asks Ray
    return pool


@pytest.mark.parametrize(
    ("both", "pooled_only", "resizes"),
    [
        ({}, {}, True),
        ({"strategy": "SPREAD"}, {}, True),
        ({"strategy": "STRICT_PACK"}, {}, False),
        ({"strategy": "STRICT_SPREAD"}, {}, False),
        ({"scope": "0123abcd"}, {}, False),  # a Tune trial's placement group
        ({}, {"strategy": "SPREAD"}, False),
        ({}, {"bundle": (("CPU", 2.0),)}, False),
        ({}, {"session": "s/2"}, False),  # workers of another Ray session or job
        ({}, {"process_env": (("MALLOC_ARENA_MAX", "1"),)}, False),  # started otherwise
    ],
)
def test_only_own_soft_groups_of_the_same_bundle_and_session_resize(both, pooled_only, resizes):
    pooled = dataclasses.replace(KEY, num_workers=3, **{**both, **pooled_only})
    wanted = dataclasses.replace(KEY, **both)
    assert pooled.resizes_to(wanted) is resizes


def test_a_group_of_the_same_size_is_not_a_resize():
    assert not KEY.resizes_to(KEY)


def test_the_smallest_larger_group_is_taken_first():
    groups = [_idle(1), _idle(5), _idle(3)]
    pool = _pool(*groups)
    assert pool.take_resized(KEY) is groups[2]
    assert pool.take_resized(KEY) is groups[1]
    assert pool.take_resized(KEY) is groups[0]  # then a smaller one: workers are added
    assert pool.take_resized(KEY) is None
    assert pool.stats()["resized"] == 3


def test_among_smaller_groups_the_largest_is_taken():
    wanted = dataclasses.replace(KEY, num_workers=8)
    groups = [_idle(2), _idle(6), _idle(4)]
    assert _pool(*groups).take_resized(wanted) is groups[1]


def test_groups_that_cannot_resize_stay_in_the_pool():
    strict = _idle(3, strategy="STRICT_PACK")
    pool = _pool(strict, _idle(3, session="old/1"))
    assert pool.take_resized(dataclasses.replace(KEY, strategy="STRICT_PACK")) is None
    assert pool.take_resized(KEY) is None
    assert pool.idle_workers() == 6
