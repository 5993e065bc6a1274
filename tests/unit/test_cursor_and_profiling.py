"""The worker's data position between train() calls, and profile timings, without Ray."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from polytrain.trainer_api.data.cursor import DataCursor
from polytrain.trainer_api.profiling import PhaseTimer, reduce_profiles


def _loader(n: int = 10, batch: int = 2, shuffle: bool = True) -> DataLoader:
    data = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=3)
    return DataLoader(data, batch_size=batch, sampler=sampler)


class _Stream(IterableDataset):
    """An unsized data set: the cursor finds the epoch's end by reading one batch ahead."""

    def __iter__(self):
        return iter([(torch.tensor([i]),) for i in range(7)])


def _take(cursor: DataCursor, steps: int | None) -> list[int]:
    return [int(x) for (batch,) in cursor.take(steps, PhaseTimer()) for x in batch]


def test_calls_continue_the_epoch_and_the_next_epoch_reshuffles():
    cursor = DataCursor(_loader())
    cursor.seek(0, 0)
    first = _take(cursor, 2)
    assert not cursor.finish_call() and cursor.position == 2
    cursor.seek(0, 2)  # the driver's position matches: the live iterator goes on
    rest = _take(cursor, 10)  # stops at the end of the epoch, after 3 batches
    assert cursor.finish_call() and cursor.position == 5
    assert sorted(first + rest) == list(range(10))
    cursor.seek(1, 0)
    second_epoch = _take(cursor, None)
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first + rest


def test_seek_to_another_position_replays_the_epoch_and_skips():
    reference = DataCursor(_loader())
    reference.seek(0, 0)
    order = _take(reference, None)
    restarted = DataCursor(_loader())  # a restarted worker, or a loaded mid-epoch checkpoint
    restarted.seek(0, 3)
    assert _take(restarted, None) == order[6:]


def test_an_unsized_loader_ends_the_epoch_one_batch_ahead():
    cursor = DataCursor(DataLoader(_Stream(), batch_size=None))
    cursor.seek(0, 0)
    assert _take(cursor, 4) == [0, 1, 2, 3] and not cursor.finish_call()
    cursor.seek(0, 4)
    assert _take(cursor, 3) == [4, 5, 6]
    assert cursor.finish_call()  # the batch read ahead found the end
    iterator = cursor.take(2, PhaseTimer())
    with pytest.raises(TypeError):
        len(iterator)


def test_step_iterator_length_and_forced_end():
    cursor = DataCursor(_loader(n=10, batch=2))
    cursor.seek(0, 0)
    iterator = cursor.take(3, PhaseTimer(), end_epoch=True)
    assert len(iterator) == 3
    assert len(list(iterator)) == 3
    assert iterator.ends_epoch()  # a shortened epoch
    assert len(cursor.take(None, PhaseTimer())) == 2


def test_phase_timer_reports_forward_as_the_batch_time_outside_the_helpers():
    timer = PhaseTimer(enabled=True)
    timer.add("data", 1.0)
    timer.add("batch", 5.0)
    timer.add("backward", 2.0)
    timer.add("step", 1.0)
    report = timer.report(total_s=7.0)
    assert report == {
        "data_s": 1.0,
        "forward_s": 2.0,
        "backward_s": 2.0,
        "step_s": 1.0,
        "other_s": 1.0,
        "total_s": 7.0,
    }
    disabled = PhaseTimer()
    with disabled.phase("data"):
        pass
    assert disabled.totals["data"] == 0.0


def test_profiles_reduce_to_the_mean_and_the_slowest_total():
    reduced = reduce_profiles([{"data_s": 1.0, "total_s": 4.0}, {"data_s": 3.0, "total_s": 6.0}])
    assert reduced == {"data_s": 2.0, "total_s": 5.0, "max_total_s": 6.0}
    assert reduce_profiles([None, None]) == {}
