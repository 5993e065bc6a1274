"""The ``parallelism=`` option's arithmetic: sizes, the mesh laid out by node, its groups (no torch).

The layout test is the one that fails if the mesh order is wrong: on two nodes of
two workers, HSDP 2x2 must replicate across the nodes and shard inside them, and
TP must stay inside a node, whatever order Ray gave the ranks in.
"""

from __future__ import annotations

import pytest

from polytrain.backends.core.parallelism import (
    Parallelism,
    coordinates,
    data_parallel_rank,
    groups,
    mesh_ranks,
    mesh_request,
)
from polytrain.errors import ConfigError, ConfigTypeError

TWO_NODES = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (node rank, local rank) of world ranks 0..3


def test_sizes_resolve_with_the_rest_and_refuse_a_product_that_does_not_match():
    assert Parallelism.from_value({"tp": 2}).resolve(4).shape == (1, 2, 2)
    assert Parallelism.from_value({"dp_replicate": 2, "dp_shard": 2}).resolve(4).shape == (2, 2, 1)
    assert Parallelism.from_value({"dp_replicate": -1, "tp": 2}).resolve(8).shape == (4, 1, 2)
    assert Parallelism.from_value(None) is None
    with pytest.raises(ConfigError, match=r"dp_replicate \* dp_shard \* tp = 8, but num_workers=4"):
        Parallelism.from_value({"dp_replicate": 2, "dp_shard": 2, "tp": 2}).resolve(4)
    with pytest.raises(ConfigError, match="multiple of 3 workers"):
        Parallelism.from_value({"tp": 3}).resolve(4)
    with pytest.raises(ConfigError, match="at most one size may be 'the rest'"):
        Parallelism.from_value({"dp_replicate": -1, "dp_shard": -1})
    with pytest.raises(ConfigTypeError, match=r"Unknown parallelism key\(s\) \['pp'\]"):
        Parallelism.from_value({"pp": 2})
    with pytest.raises(ConfigTypeError, match="must be an int"):
        Parallelism.from_value({"tp": "2"})
    with pytest.raises(ConfigError, match="must be >= 1, or -1"):
        Parallelism.from_value({"tp": 0})


def test_hsdp_replicates_across_nodes_and_shards_inside_them():
    sizes = Parallelism(dp_replicate=2, dp_shard=2)
    layout = mesh_ranks(sizes, TWO_NODES)
    assert groups(layout, "dp_shard") == [[0, 1], [2, 3]]  # each inside one node
    assert groups(layout, "dp_replicate") == [[0, 2], [1, 3]]  # each across both nodes
    # Ray may hand out ranks in any node order: the layout follows the nodes, not the ranks.
    shuffled = [(1, 0), (0, 0), (1, 1), (0, 1)]
    layout = mesh_ranks(sizes, shuffled)
    assert groups(layout, "dp_shard") == [[1, 3], [0, 2]]
    assert groups(layout, "dp_replicate") == [[1, 0], [3, 2]]


def test_tp_is_the_innermost_dimension_and_stays_inside_a_node():
    layout = mesh_ranks(Parallelism(dp_shard=2, tp=2), TWO_NODES)
    assert groups(layout, "tp") == [[0, 1], [2, 3]]
    assert groups(layout, "dp_shard") == [[0, 2], [1, 3]]
    assert [coordinates(layout, r) for r in range(4)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    sizes = Parallelism(dp_replicate=2, dp_shard=1, tp=2)
    # TP peers share a data-parallel rank: they must read the same batches.
    layout = mesh_ranks(sizes, TWO_NODES)
    assert [data_parallel_rank(sizes, coordinates(layout, r)) for r in range(4)] == [0, 0, 1, 1]
    eight = [(n, i) for n in range(2) for i in range(4)]
    layout = mesh_ranks(Parallelism(dp_replicate=2, dp_shard=2, tp=2), eight)
    assert groups(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp_larger_than_a_node_or_not_dividing_it_is_refused():
    with pytest.raises(ConfigError, match="node 0 has 2 worker.*multiple of tp"):
        mesh_ranks(Parallelism(dp_shard=1, tp=4), TWO_NODES)
    three_and_one = [(0, 0), (0, 1), (0, 2), (1, 0)]
    with pytest.raises(ConfigError, match="node 0 has 3 worker"):
        mesh_ranks(Parallelism(dp_shard=2, tp=2), three_and_one)


def test_a_request_is_plain_data_parallel_unless_it_asks_for_a_mesh():
    assert mesh_request(None, None, 4) is None
    assert mesh_request({"dp_shard": -1}, None, 4) is None
    assert mesh_request({"tp": 2}, None, 4).shape == (1, 2, 2)
    with pytest.raises(ConfigError, match="has tp=1"):
        mesh_request({"dp_shard": 4}, {"q": "colwise"}, 4)
    with pytest.raises(ConfigError, match="cannot shrink: drop scaling min_workers=2"):
        mesh_request({"tp": 2}, None, 4, min_workers=2)
