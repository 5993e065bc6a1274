"""The autoscaler helpers' pure functions (polytrain.launchers.cluster.autoscaler), without Ray."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from polytrain.launchers.cluster.autoscaler import (
    ClusterShape,
    NodeType,
    bundles_per_node,
    can_ever_fit,
    live_counts_from_status,
    node_setup_commands,
    nodes_to_add,
    pending_from_status,
    shape_from_config,
    start_timeout,
    waiting_message,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAD = {"CPU": 0.0, "memory": 2.0**33, "node:__internal_head__": 1.0}
# Ray's fake multi-node autoscaler as the issue ran it: a 0-CPU head, 2-CPU nodes, max 2.
FAKE = ClusterShape((NodeType("cpu_node", {"CPU": 2.0}, 0, 2),), max_workers=2)
CPU_GPU = ClusterShape(
    (NodeType("cpu", {"CPU": 8.0}, 0, 4), NodeType("gpu", {"CPU": 4.0, "GPU": 1.0}, 0, 2)),
    max_workers=6,
)


def test_bundles_per_node():
    assert bundles_per_node({"CPU": 8, "GPU": 1}, {"CPU": 2}) == 4
    assert bundles_per_node({"CPU": 8, "GPU": 1}, {"CPU": 2, "GPU": 1}) == 1
    assert bundles_per_node({"CPU": 8}, {"CPU": 1, "GPU": 1}) == 0
    assert bundles_per_node({"CPU": 0.3 * 10}, {"CPU": 0.3}) == 10  # float rounding


def test_workers_that_need_new_nodes_can_fit():
    ok, reason = can_ever_fit({"CPU": 2}, 2, [HEAD], FAKE)
    assert ok and "autoscaler" in reason
    assert nodes_to_add({"CPU": 2}, 2, [HEAD], FAKE) == {"cpu_node": 2}


def test_live_nodes_alone():
    ok, reason = can_ever_fit({"CPU": 1}, 4, [{"CPU": 4.0}], FAKE)
    assert ok and reason == "fits the live nodes"


@pytest.mark.parametrize(
    "bundle, count, words",
    [
        ({"CPU": 2}, 3, ["3 worker(s)", "cpu_node (CPU: 2) holds 1 per node", "2 more node"]),
        ({"CPU": 4}, 1, ["holds 0 per node"]),
        ({"CPU": 1, "GPU": 1}, 1, ["GPU: 1", "holds 0 per node"]),
    ],
)
def test_impossible_requests_say_why(bundle, count, words):
    ok, reason = can_ever_fit(bundle, count, [HEAD], FAKE)
    assert not ok
    for word in words:
        assert word in reason


def test_cluster_node_limit_binds():
    shape = ClusterShape((NodeType("a", {"CPU": 1.0}, 0, 5), NodeType("b", {"CPU": 1.0}, 0, 5)), 3)
    assert can_ever_fit({"CPU": 1}, 3, [HEAD], shape)[0]
    ok, reason = can_ever_fit({"CPU": 1}, 4, [HEAD], shape)
    assert not ok and "3 more node(s) in all" in reason
    # Two nodes of the types already run: only one more may join.
    assert not can_ever_fit({"CPU": 1}, 2, [HEAD], shape, live_counts={"a": 2})[0]


def test_roomiest_types_first_under_a_node_limit():
    shape = ClusterShape(
        (NodeType("small", {"CPU": 2.0}, 0, 9), NodeType("big", {"CPU": 8.0}, 0, 1)), 2
    )
    # 1 big (4 bundles) + 1 small (1 bundle) = 5.
    assert can_ever_fit({"CPU": 2}, 5, [], shape)[0]
    assert not can_ever_fit({"CPU": 2}, 6, [], shape)[0]


def test_gpu_only_on_gpu_type():
    assert can_ever_fit({"CPU": 1, "GPU": 1}, 2, [HEAD], CPU_GPU)[0]
    ok, reason = can_ever_fit({"CPU": 1, "GPU": 1}, 3, [HEAD], CPU_GPU)
    assert not ok and "gpu (CPU: 4, GPU: 1) holds 1 per node, up to 2 more" in reason
    assert nodes_to_add({"CPU": 1, "GPU": 1}, 2, [HEAD], CPU_GPU) == {"gpu": 2}


def test_unlimited_and_undeclared_types_err_towards_waiting():
    unlimited = ClusterShape((NodeType("cpu", {"CPU": 2.0}, 0, None),))
    assert can_ever_fit({"CPU": 2}, 1000, [], unlimited)[0]
    undeclared = ClusterShape((NodeType("cpu", {}, 0, 2),), 2)  # resources set at launch
    assert can_ever_fit({"CPU": 64, "GPU": 8}, 2, [], undeclared)[0]
    assert not can_ever_fit({"CPU": 1}, 1, [], ClusterShape(()))[0]


def test_strict_strategies():
    assert not can_ever_fit({"CPU": 2}, 2, [HEAD], FAKE, strategy="STRICT_PACK")[0]
    assert can_ever_fit({"CPU": 1}, 2, [HEAD], FAKE, strategy="STRICT_PACK")[0]
    assert can_ever_fit({"CPU": 1}, 2, [HEAD], FAKE, strategy="STRICT_SPREAD")[0]
    ok, reason = can_ever_fit({"CPU": 1}, 3, [HEAD], FAKE, strategy="STRICT_SPREAD")
    assert not ok and "on distinct nodes" in reason


def test_progress_from_the_autoscaler_status():
    # The shape of Ray 2.60's __autoscaling_status JSON (fake multi-node autoscaler).
    status = {
        "monitor_pid": 1,
        "autoscaler_report": {
            "active_nodes": {"ray.head.default": 1},
            "pending_launches": {"cpu_node": 1},
            "pending_nodes": [["fff01", "cpu_node", "uninitialized"]],
        },
    }
    pending = pending_from_status(status)
    assert pending == {"cpu_node": 2}
    assert waiting_message(pending, 40.4) == (
        "waiting for 2 x cpu_node from the autoscaler, 40 s so far"
    )
    assert waiting_message({"a": 1, "b": 2}, 5) == (
        "waiting for 1 x a and 2 x b from the autoscaler, 5 s so far"
    )
    assert waiting_message({}, 0) == "waiting for nodes from the autoscaler, 0 s so far"
    assert live_counts_from_status(status) == {"ray.head.default": 1}
    assert pending_from_status(None) == {} and live_counts_from_status({}) == {}


def test_shape_from_cluster_launcher_yaml():
    config = yaml.safe_load((REPO_ROOT / "examples/cluster/gcp.yaml").read_text())
    shape = shape_from_config(config, "gcp.yaml")
    by_name = {t.name: t for t in shape.node_types}
    assert set(by_name) == {"ray_worker_cpu", "ray_worker_gpu"}  # not the head
    assert by_name["ray_worker_gpu"].resources == {"CPU": 8.0, "GPU": 1.0}
    assert (by_name["ray_worker_gpu"].min_workers, by_name["ray_worker_gpu"].max_workers) == (0, 2)
    assert shape.max_workers == 6
    assert "ray_worker_gpu {CPU: 8, GPU: 1} x 0-2" in shape.describe()


def test_shape_defaults_follow_ray():
    # A node type without max_workers may use the whole cluster limit (Ray's default).
    config = {
        "max_workers": 3,
        "head_node_type": "head",
        "available_node_types": {"head": {"resources": {}}, "w": {"resources": {"CPU": 1}}},
    }
    (only,) = shape_from_config(config).node_types
    assert (only.name, only.min_workers, only.max_workers) == ("w", 0, 3)


def test_shape_from_kuberay_manifest():
    manifest = yaml.safe_load((REPO_ROOT / "examples/cluster/kuberay/raycluster.yaml").read_text())
    shape = shape_from_config(manifest)
    by_name = {t.name: t for t in shape.node_types}
    assert by_name["gpu"].resources["GPU"] == 1 and by_name["gpu"].max_workers == 2
    assert by_name["cpu"].resources["CPU"] == 4 and by_name["cpu"].max_workers == 4
    assert not math.isinf(shape.max_workers)


def test_setup_commands_per_node_type():
    config = {
        "head_node_type": "head",
        "setup_commands": ["common"],
        "head_setup_commands": ["head only"],
        "worker_setup_commands": ["workers"],
        "available_node_types": {
            "head": {},
            "plain": {},
            "own": {"worker_setup_commands": ["replaces everything"]},
        },
    }
    assert node_setup_commands(config) == {
        "head": ["common", "head only"],
        "plain": ["common", "workers"],
        "own": ["replaces everything"],
    }


def test_start_timeout_is_minutes_only_where_an_autoscaler_may_add_nodes():
    from polytrain.launchers.cluster.autoscaler import AUTOSCALER_START_TIMEOUT_S, START_TIMEOUT_S
    from polytrain.launchers.scaling import ScalingConfig

    default = ScalingConfig(num_workers=2).start_timeout_s
    assert default is None
    assert start_timeout(default, None) == START_TIMEOUT_S == 30.0
    assert start_timeout(default, FAKE) == AUTOSCALER_START_TIMEOUT_S >= 300
    # A value the user gives is used as given, with or without an autoscaler.
    assert start_timeout(5.0, FAKE) == start_timeout(5.0, None) == 5.0
    assert start_timeout(0.0, FAKE) == 0.0


@pytest.mark.parametrize("runs", [True, False])
def test_an_unreadable_autoscaler_is_waited_for_and_no_autoscaler_judges_live_nodes(
    monkeypatch, runs
):
    from polytrain.launchers.cluster import autoscaler

    monkeypatch.setattr(autoscaler, "read_cluster_shape", lambda: None)
    monkeypatch.setattr(autoscaler, "autoscaler_runs", lambda: runs)
    shape = autoscaler.judge_request({"CPU": 64.0}, 2, "PACK", "2 x CPU 64")
    if not runs:
        assert shape is None  # the caller checks the live nodes, and fails at once
        return
    assert shape is not None and not shape.visible
    assert start_timeout(None, shape) == start_timeout(None, FAKE) > start_timeout(None, None)
    assert waiting_message(nodes_to_add({"CPU": 64.0}, 2, [HEAD], shape), 40) == (
        "waiting for nodes from the autoscaler, 40 s so far"
    )


def test_a_watching_monitor_is_not_an_autoscaler(monkeypatch):
    """Every cluster's monitor reports a status; only one with node types can add nodes."""
    from polytrain.launchers.cluster import autoscaler_status

    read_only = {"autoscaler_report": {"node_type_mapping": {"ab12": "node_ab12"}}}
    real = {"autoscaler_report": {"node_type_mapping": {"ab12": "ray.head.default"}}}
    for status, expected in ((read_only, False), (real, True)):
        monkeypatch.setattr(autoscaler_status, "read_autoscaler_status", lambda s=status: s)
        assert autoscaler_status.autoscaler_runs() is expected
