"""Ray Train's ``v2/tests/test_collective.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same tests: ``barrier`` holds every rank until both arrived (a Ray actor counts the
arrivals), ``broadcast_from_rank_zero`` gives rank 0's value to every rank, and data
over the size limit is refused with a ``ValueError`` (outside a loop too).

Fixture changes: the session's shared Ray instance.
"""

from __future__ import annotations

import pytest
import ray

import polytrain.train
import polytrain.train.collective
from polytrain.train import DataParallelTrainer
from polytrain.train.collective import collectives

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")


def test_barrier():
    @ray.remote(num_cpus=0)
    class Counter:
        def __init__(self) -> None:
            self.arrived = 0

        def increment(self) -> None:
            self.arrived += 1

        def count(self) -> int:
            return self.arrived

    counter = Counter.remote()

    def train_fn():
        # The other rank may be slow to start: only the barrier makes the count 2 here.
        ray.get(counter.increment.remote())
        polytrain.train.collective.barrier()
        assert ray.get(counter.count.remote()) == 2

    DataParallelTrainer(train_fn, scaling_config=polytrain.train.ScalingConfig(num_workers=2)).fit()


def test_broadcast_from_rank_zero():
    def train_fn():
        rank = polytrain.train.get_context().get_world_rank()
        value = polytrain.train.collective.broadcast_from_rank_zero({"key": rank})
        assert value == {"key": 0}

    DataParallelTrainer(train_fn, scaling_config=polytrain.train.ScalingConfig(num_workers=2)).fit()


def test_broadcast_from_rank_zero_data_too_big(monkeypatch):
    monkeypatch.setattr(collectives, "_MAX_BROADCAST_SIZE_BYTES", 0)
    with pytest.raises(ValueError, match="bytes pickled"):
        polytrain.train.collective.broadcast_from_rank_zero({"key": "value"})
