"""Rank, address and environment bookkeeping, without Ray."""

from __future__ import annotations

import pytest

from polytrain.launchers.ranks import (
    WorkerMetadata,
    compute_ranks,
    order_by_node,
    shared_visible_devices,
    split_batch_size,
    torch_distributed_env,
)


def test_order_by_node_groups_colocated_workers_stably():
    nodes = ["b", "a", "b", "c", "a"]
    order = order_by_node(nodes)
    assert [nodes[i] for i in order] == ["b", "b", "a", "a", "c"]
    assert order == [0, 2, 1, 4, 3]


def test_compute_ranks_local_and_node_ranks():
    infos = compute_ranks(["n1", "n1", "n2", "n2", "n2"])
    assert [i.world_rank for i in infos] == [0, 1, 2, 3, 4]
    assert [i.local_rank for i in infos] == [0, 1, 0, 1, 2]
    assert [i.local_world_size for i in infos] == [2, 2, 3, 3, 3]
    assert [i.node_rank for i in infos] == [0, 0, 1, 1, 1]
    assert {i.world_size for i in infos} == {5}


def test_shared_visible_devices_per_node():
    meta = [
        WorkerMetadata("n1", "10.0.0.1", "h1", 1, ("3",)),
        WorkerMetadata("n1", "10.0.0.1", "h1", 2, ("1",)),
        WorkerMetadata("n2", "10.0.0.2", "h2", 3, ("0",)),
        WorkerMetadata("n1", "10.0.0.1", "h1", 4, ("10",)),
    ]
    assert shared_visible_devices(meta) == [("1,3,10", 1), ("1,3,10", 0), ("0", 0), ("1,3,10", 2)]


def test_torch_distributed_env_matches_torchrun():
    env = torch_distributed_env(compute_ranks(["a", "b"])[1], "10.0.0.1", 29500)
    assert env == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
    }


@pytest.mark.parametrize(
    ("batch", "workers", "per_worker"), [(64, 2, 32), (65, 2, 32), (7, 0, 7), (3, 3, 1)]
)
def test_split_batch_size(batch, workers, per_worker):
    assert split_batch_size(batch, workers) == per_worker


def test_split_batch_size_smaller_than_workers_is_an_error():
    with pytest.raises(ValueError, match=r"batch_size'\]=2 .* at least num_workers=4"):
        split_batch_size(2, 4)
