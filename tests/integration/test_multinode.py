"""Every backend across nodes, on a simulated three-node Ray cluster (issue 17, point 1).

``ray.cluster_utils.Cluster`` runs a head (127.0.0.1, 0 CPUs) and two 2-CPU worker
nodes (127.0.0.2, 127.0.0.3), each with its own raylet, on this machine. It cannot
share the test session's Ray instance (a driver joins one cluster per process), so
tests/integration/multinode_script.py builds it once in a fresh process with a
private, short ``RAY_TMPDIR`` (Cluster writes its address into ``<tmp>/ray/ray_current_cluster``;
the machine's ``/tmp/ray`` stays untouched), runs every backend's check there and
writes JSON; the module-scoped fixture runs it once and the tests read the JSON.

Per backend: workers on both worker nodes (SPREAD), world / local / node ranks,
rendezvous addresses that are the workers' node IPs (MASTER_ADDR, Horovod's
rendezvous and host names, TF_CONFIG), the interface gloo binds to, and the same
weights as one process training on the same global batches. Then a worker node is
drained mid-epoch (a preemption with a deadline): the group stops after an agreed
step, checkpoints there and goes on, elastic, on the node left, losing no step and
using none of ``max_retries``. Then a worker node is removed mid-epoch, gracefully
(horovod) and by SIGKILL (ddp), and training goes on after one restart with the same
weights as an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polytrain.launchers.network import interface_with_address
from tests.integration.fresh_cluster import run_script_on_fresh_cluster

SCRIPT = Path(__file__).with_name("multinode_script.py")
WORKER_IPS = {"127.0.0.2", "127.0.0.3"}
BACKENDS = ["ddp", "horovod", "fairscale", "fsdp", "deepspeed", "mwms"]
TORCH_DIST = {"ddp", "fairscale", "fsdp", "deepspeed"}  # one torch.distributed process group


def _run_script(tmp_path_factory, *args: str) -> dict:
    tmp = tmp_path_factory.mktemp("multinode")
    return run_script_on_fresh_cluster(SCRIPT, tmp / "result.json", *args)


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    return _run_script(tmp_path_factory, *BACKENDS)


@pytest.fixture(scope="module")
def drained(request, tmp_path_factory):
    """The drain case: from the full run when other tests here need it, else on its own."""
    others = [
        item
        for item in request.session.items
        if "multinode" in getattr(item, "fixturenames", ()) and item.module is request.module
    ]
    if others:
        return request.getfixturevalue("multinode")["drain"]
    return _run_script(tmp_path_factory, "ddp", "--drain-only")["drain"]


def _backend(multinode: dict, name: str) -> dict:
    result = multinode["backends"][name]
    if result["status"] == "skipped":
        pytest.skip(result["reason"])
    assert result["status"] == "ok", result["error"]
    return result


def _expected_ranks(ips: list[str]) -> list[tuple[int, int, int, int]]:
    """(world rank, local rank, local world size, node rank) for workers on ``ips`` in rank order."""
    node_rank: dict[str, int] = {}
    seen: dict[str, int] = {}
    expected = []
    for rank, ip in enumerate(ips):
        node_rank.setdefault(ip, len(node_rank))
        expected.append((rank, seen.get(ip, 0), ips.count(ip), node_rank[ip]))
        seen[ip] = seen.get(ip, 0) + 1
    return expected


def test_cluster_is_a_cpu_less_head_and_two_worker_nodes(multinode):
    assert set(multinode["nodes"]) == {"127.0.0.1", *WORKER_IPS}
    assert multinode["cluster_cpus"] == 4.0  # the head has none: every worker is on a worker node
    assert multinode["driver_node_ip"] == "127.0.0.1"
    # The head listens on the loopback only; ensure_ray reached it over the loopback
    # although Ray itself would dial this host's outward address.
    assert multinode["plan"] in ("loopback", "connect")


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_are_spread_over_the_worker_nodes(multinode, backend):
    workers = _backend(multinode, backend)["workers"]
    ips = [w["node_ip"] for w in workers]
    assert set(ips) == WORKER_IPS
    assert all(ips.count(ip) == len(ips) // 2 for ip in WORKER_IPS)
    for worker in workers:
        assert worker["node_id"] == multinode["nodes"][worker["node_ip"]]
    # co-located workers have contiguous ranks
    assert ips == sorted(ips, key=ips.index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_follow_the_nodes(multinode, backend):
    result = _backend(multinode, backend)
    workers = result["workers"]
    expected = _expected_ranks([w["node_ip"] for w in workers])
    size = len(workers)
    if backend == "mwms":
        tasks = [json.loads(w["env"]["TF_CONFIG"])["task"] for w in workers]
        assert tasks == [{"type": "worker", "index": i} for i in range(size)]
        return
    for worker, (rank, local, local_size, node) in zip(workers, expected, strict=True):
        env = worker["env"]
        if backend == "horovod":
            assert env["HOROVOD_RANK"] == str(rank)
            assert env["HOROVOD_LOCAL_RANK"] == str(local)
            assert env["HOROVOD_CROSS_RANK"] == str(node)
        else:
            got = (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"])
            assert got == (str(rank), str(local), str(local_size), str(node))
            assert env["WORLD_SIZE"] == str(size)
    if backend == "horovod":  # what hvd itself reports: rank, size, local rank, cross rank/size
        assert result["framework_ranks"] == [[r, size, lr, n, 2] for r, lr, _, n in expected]
    else:  # what torch.distributed reports
        assert result["framework_ranks"] == [[r, size] for r, *_ in expected]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rendezvous_addresses_are_node_ips(multinode, backend):
    workers = _backend(multinode, backend)["workers"]
    envs = [w["env"] for w in workers]
    if backend in TORCH_DIST:
        # rank 0's node hosts the TCP store; every worker dials it there
        assert {e["MASTER_ADDR"] for e in envs} == {workers[0]["node_ip"]}
    elif backend == "horovod":
        # the rendezvous server runs in the driver, on the head node
        assert {e["HOROVOD_GLOO_RENDEZVOUS_ADDR"] for e in envs} == {multinode["driver_node_ip"]}
        assert [e["HOROVOD_HOSTNAME"] for e in envs] == [w["node_id"] for w in workers]
    else:
        cluster = json.loads(envs[0]["TF_CONFIG"])["cluster"]["worker"]
        assert [a.rsplit(":", 1)[0] for a in cluster] == [w["node_ip"] for w in workers]
        assert all(json.loads(e["TF_CONFIG"])["cluster"]["worker"] == cluster for e in envs)


@pytest.mark.parametrize("backend", sorted(TORCH_DIST | {"horovod"}))
def test_gloo_binds_the_interface_of_the_node_ip(multinode, backend):
    """GLOO_SOCKET_IFNAME / HOROVOD_GLOO_IFACE name the interface holding the worker's node IP."""
    for worker in _backend(multinode, backend)["workers"]:
        expected = interface_with_address(worker["node_ip"])  # the same host here
        assert expected is not None
        variable = "HOROVOD_GLOO_IFACE" if backend == "horovod" else "GLOO_SOCKET_IFNAME"
        assert worker["env"][variable] == expected, (worker["node_ip"], worker["env"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_across_nodes_matches_one_process(multinode, backend):
    result = _backend(multinode, backend)
    assert result["max_diff"] <= result["tol"], result["max_diff"]


@pytest.mark.parametrize("kind", ["graceful", "hard"])
def test_node_removed_mid_epoch_is_survived(multinode, kind):
    result = multinode["node_loss"][kind]
    if result["status"] == "skipped":
        pytest.skip(f"{result['backend']} is not installed")
    assert result["status"] == "ok", result["error"]
    assert result["graceful"] is (kind == "graceful")
    assert "worker_pid" in result["removed"]  # the node went away while epoch 1 ran
    assert {w["node_ip"] for w in result["before"]} == WORKER_IPS
    # the restarted group runs on the node that is left
    assert {w["node_ip"] for w in result["after"]} == {"127.0.0.2"}
    assert result["num_restarts"] == 1
    assert result["epochs"] == [0, 1, 2]
    # the interrupted epoch was re-run from the last epoch end: same weights as no failure
    assert result["max_diff"] <= 1e-5, result["max_diff"]


def test_a_drained_node_is_left_at_a_step_with_no_step_lost(drained):
    assert drained["status"] == "ok", drained.get("error")
    assert drained["drained"]["accepted"][0] is True  # the GCS took the drain request
    victim = drained["victim"]
    before = {w["node_id"] for w in drained["before"]}
    assert victim in before and len(before) == 2
    # the group went on, elastic, on the node left; the drained node got no worker
    assert {w["node_id"] for w in drained["after"]} == before - {victim}
    assert drained["num_workers"] == [1, 1]
    # a preemption, counted apart: max_retries=0 survived it
    assert drained["drains"] == 1 and drained["restarts"] == 0
    assert drained["epochs"] == [0, 1] and drained["num_steps"] == [16, 16]
    # every batch of both epochs trained exactly once, the stop mid-epoch 0
    batches = [(int(e), int(b), int(w)) for e, b, w in drained["batches"]]
    assert [(e, b) for e, b, _ in batches] == [(e, b) for e in (0, 1) for b in range(16)]
    stop = next(i for i, (_, _, w) in enumerate(batches) if w == 1)
    assert 4 <= stop < 16 and all(w == 2 for _, _, w in batches[:stop])
    # the same weights as one process on the same global batches: none lost or repeated
    assert drained["max_diff"] <= 1e-5, drained["max_diff"]
    lines = drained["log"]
    ip = next(w["node_ip"] for w in drained["before"] if w["node_id"] == victim)
    assert any(
        line.startswith(f"Node {victim} ({ip}) is draining (preemption, deadline in ")
        for line in lines
    ), lines
    assert any(
        line.startswith("Drain 1 (failure_config max_drains=unlimited)") for line in lines
    ), lines
    assert drained["seconds"] < 60


def test_tf_leaves_a_drained_node_at_the_end_of_the_running_epoch(multinode):
    """TFTrainer's calls are whole epochs: a drain during one is acted on at its end."""
    result = multinode.get("tf_drain") or pytest.skip("TensorFlow (mwms) is not installed")
    assert result["status"] == "ok", result.get("error")
    assert result["drained"]["accepted"][0] is True
    victim = result["victim"]
    before = {w["node_id"] for w in result["before"]}
    assert victim in before and len(before) == 2
    assert {w["node_id"] for w in result["after"]} == before - {victim}
    # the epoch under way finished on both workers; the next ran on the node left
    assert result["num_workers"] == [2, 1] and result["epochs"] == [0, 1]
    # whole epochs (the digits set is 23 steps of 64): none cut short, none lost
    assert result["num_steps"][0] == result["num_steps"][1] > 0
    assert result["drains"] == 1 and result["restarts"] == 0
    lines = result["log"]
    assert any(
        f"Node {victim} (" in line and "finish their current training call (an epoch)" in line
        for line in lines
    ), lines
    assert any(line.startswith("Drain 1 (failure_config max_drains=") for line in lines)
