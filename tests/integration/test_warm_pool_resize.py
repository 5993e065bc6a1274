"""Warm workers serve another world size (issue 14, point 2): real Ray actors, real gloo groups.

A group smaller than a pooled one uses its first workers (the others wait beside it
and go back to the pool with it); a larger one adopts the pooled workers and adds
the missing ones in a second placement group. Either way the process group is
rebuilt for the new world size on the warm processes (identified by their pids).
"""

from __future__ import annotations

import os

import pytest
import torch

from polytrain.errors import InsufficientResourcesError
from polytrain.launchers.pool import warm_pool as pool
from polytrain.launchers.process_env import single_arena_env
from tests.integration.test_warm_pool import (  # noqa: F401 - empty_pool is an autouse fixture
    _cpus_free,
    _group,
    _pids,
    _trainer,
    _wait_until,
    empty_pool,
)

# Every test starts with an empty warm pool: these tests count the pool's own groups and reuses.
KEEP_WARM_POOL = False


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_smaller_trainer_uses_the_first_workers_of_a_larger_warm_group(ray_start_4_cpus):
    resized_before = pool.stats()["resized"]  # the pool's counts run for the whole process
    first = _trainer(num_workers=3, config={"batch_size": 60})
    first.train(num_steps=1)
    pids = first.apply_all_workers(os.getpid)
    first.shutdown()
    assert pool.idle_workers() == 3

    second = _trainer(num_workers=2, config={"batch_size": 60})
    assert second._group.reused and second._group.resized_from == 3
    assert second.apply_all_workers(os.getpid) == pids[:2]
    assert pool.idle_workers() == 0  # the third waits beside the group, not in the pool
    stats = second.train(num_steps=2)  # a process group of 2 on the warm workers
    assert torch.isfinite(torch.tensor(stats["loss"]))
    assert second.apply_all_workers(_world_size) == [2, 2]
    second.shutdown()

    # All three come back together: a group of three takes them as they were.
    assert pool.idle_workers() == 3 and pool.stats()["resized"] == resized_before + 1
    third = _group(num_workers=3, process_env=single_arena_env())  # as the trainers' started
    assert third.reused and third.resized_from is None
    assert sorted(_pids(third)) == sorted(pids)
    third.shutdown()


def test_larger_trainer_adds_workers_to_a_smaller_warm_group(ray_start_4_cpus):
    first = _trainer(num_workers=1, config={"batch_size": 60})
    first.train(num_steps=1)
    (warm_pid,) = first.apply_all_workers(os.getpid)
    first.shutdown()

    second = _trainer(num_workers=3, config={"batch_size": 60})
    assert second._group.reused and second._group.resized_from == 1
    pids = second.apply_all_workers(os.getpid)
    assert warm_pid in pids and len(set(pids)) == 3
    stats = second.train(num_steps=2)
    assert torch.isfinite(torch.tensor(stats["loss"]))
    assert second.apply_all_workers(_world_size) == [3, 3, 3]
    second.shutdown()

    # The grown group is pooled whole, and stopping it removes both placement groups.
    assert pool.idle_workers() == 3
    again = _group(num_workers=3, process_env=single_arena_env())
    assert again.reused and sorted(_pids(again)) == sorted(pids)
    again.shutdown()
    assert pool.clear() == 3
    _wait_until(lambda: _cpus_free(ray_start_4_cpus))


def test_a_failed_resized_group_stops_its_spare_workers_too(ray_start_4_cpus):
    first = _group(num_workers=3)
    first.shutdown()
    second = _group(num_workers=1)
    assert second.resized_from == 3
    with pytest.raises(ValueError, match="boom"):
        second.execute(_fail)
    second.shutdown()
    assert pool.idle_workers() == 0
    _wait_until(lambda: _cpus_free(ray_start_4_cpus))


def test_a_grown_group_that_cannot_be_placed_leaves_nothing_running(ray_start_4_cpus):
    first = _group(num_workers=1)
    first.shutdown()
    # 4 CPUs: the 5 workers to add can never fit; the adopted worker is stopped too.
    with pytest.raises(InsufficientResourcesError, match="5 worker"):
        _group(num_workers=6)
    assert pool.idle_workers() == 0
    _wait_until(lambda: _cpus_free(ray_start_4_cpus))


def test_strict_strategies_are_not_resized(ray_start_4_cpus):
    first = _group(num_workers=2, placement_strategy="STRICT_PACK")
    pids = _pids(first)
    first.shutdown()
    other = _group(num_workers=1, placement_strategy="STRICT_PACK")
    assert not other.reused and set(_pids(other)).isdisjoint(pids)
    other.shutdown()


def _fail() -> None:
    raise ValueError("boom")
