"""Run by test_pool_placement.py in a fresh process: where groups land with and without the pool.

Usage: ``python pool_placement_script.py OUT.json`` with ``RAY_TMPDIR`` pointing at a
private directory (see multinode_script.py, whose cluster this one repeats: a head
on 127.0.0.1 with 0 CPUs and two 2-CPU worker nodes on 127.0.0.2 and 127.0.0.3).

Per case, twice (warm pool off, then on): a first group of 2 workers starts and
shuts down (with the pool on it stays idle in the pool), then a second group of 2
starts with another strategy; the node IPs of both are recorded, with whether the
second reused pooled workers and how many idle groups it made yield. With the pool
off the second group starts once the first one's resources show free again (the
reference placement). Everything is stopped between runs. Written to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(  # the raylets' workers import polytrain
    [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

CASES = {
    "SPREAD after PACK": ("PACK", "SPREAD"),
    "SPREAD after STRICT_PACK": ("STRICT_PACK", "SPREAD"),
    "PACK after SPREAD": ("SPREAD", "PACK"),
    "STRICT_SPREAD after PACK": ("PACK", "STRICT_SPREAD"),
}


def start_cluster():
    """multinode_script.py's cluster (that module turns the pool off on import)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for ip in ("127.0.0.2", "127.0.0.3"):
        cluster.add_node(num_cpus=2, node_ip_address=ip)
    cluster.wait_for_nodes()
    return cluster


def _start(strategy: str):
    from polytrain.launchers.worker_group import RayWorkerGroup

    group = RayWorkerGroup(
        num_workers=2, placement_strategy=strategy, start_timeout_s=60, preload=()
    )
    group.start()
    return group


def _wait_all_free() -> None:
    import ray

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return
        time.sleep(0.1)
    raise RuntimeError(f"resources not given back: {ray.available_resources()}")


def run_case(first: str, second: str, pooled: bool) -> dict:
    from polytrain.launchers.pool import warm_pool as pool

    pool.configure(enabled=pooled)
    before = pool.stats()
    group = _start(first)
    first_ips = [m.node_ip for m in group.metadata]
    group.shutdown()
    idle = pool.idle_workers()
    if not pooled:
        # The reference: the second group placed on a quiet cluster. Ray shows a stopped
        # group's resources free only a moment after shutdown() (actors killed, placement
        # group removed); placed before that, even a pool-off SPREAD packs beside them.
        _wait_all_free()
    group = _start(second)
    result = {
        "first": first_ips,
        "second": [m.node_ip for m in group.metadata],
        "idle_before_second": idle,
        "second_reused": group.reused,
        "stopped": pool.stats()["stopped"] - before["stopped"],
    }
    group.shutdown()
    pool.clear()
    _wait_all_free()
    return result


def main(out_path: str) -> None:
    import ray

    from polytrain.launchers.cluster.connect import ensure_ray

    cluster = start_cluster()
    result: dict = {"cases": {}}
    try:
        ensure_ray(cluster.address, timeout_s=60)
        result["nodes"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        for name, (first, second) in CASES.items():
            try:
                result["cases"][name] = {
                    "off": run_case(first, second, pooled=False),
                    "on": run_case(first, second, pooled=True),
                }
            except Exception:  # noqa: BLE001 - reported to the test, which names it
                result["cases"][name] = {"error": traceback.format_exc()}
            print(f"[pool placement] {name}: {result['cases'][name]}", flush=True)
    finally:
        Path(out_path).write_text(json.dumps(result, indent=1))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
