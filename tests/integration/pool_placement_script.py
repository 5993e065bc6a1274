"""Run by test_pool_placement.py in a fresh process: where groups land with and without the pool.

Usage: ``python pool_placement_script.py OUT.json`` with ``RAY_TMPDIR`` pointing at a
private directory (see multinode_script.py, whose cluster this one repeats: a head
on 127.0.0.1 with 0 CPUs and two 2-CPU worker nodes on 127.0.0.2 and 127.0.0.3).

Per case, twice (warm pool off, then on): a first group of 2 workers starts and
shuts down (with the pool on it stays idle in the pool), then a second group of 2
starts with another strategy; the node IPs of both are recorded, with whether the
second reused pooled workers and how many idle groups it made yield. With the pool
off the second group starts once the first one's resources show free again (the
reference placement). Everything is stopped between runs.

Then, with the pool on (issue 39, item 2): four trainers in sequence with
``placement_strategy="SPREAD"``, 2 workers each (ddp, horovod, fairscale, fsdp), each
recording its workers' nodes and local world sizes; and three times over, two idle
SPREAD groups that fill both worker nodes, then a SPREAD group of another bundle, which
makes them yield (and once more with the two stopped outside the pool, as after a
failure), placed while Ray is still giving their bundles back. Written to OUT.json.
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


SEQUENCE = ("ddp", "horovod", "fairscale", "fsdp")


def _where() -> dict:
    """Worker: its node and the local world its backend was given."""
    import ray

    return {
        "ip": ray.util.get_node_ip_address(),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
    }


def run_sequence() -> list[dict]:
    """Four trainers one after another, SPREAD, 2 workers each; where each one's workers ran."""
    import torch

    from polytrain import TorchTrainer
    from polytrain.launchers.pool import warm_pool as pool
    from tests.helpers import parity_data_creator, parity_model_creator, parity_optimizer_creator

    pool.configure(enabled=True)
    placed = []
    for backend in SEQUENCE:
        trainer = TorchTrainer(
            model_creator=parity_model_creator,
            data_creator=parity_data_creator,
            optimizer_creator=parity_optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"batch_size": 32},
            num_workers=2,
            backend=backend,
            scaling_config={"placement_strategy": "SPREAD"},
        )
        try:
            trainer.train(num_steps=1)
            workers = trainer.apply_all_operators(
                lambda operator: {
                    **_where(),
                    "context_local_world_size": operator.context.local_world_size,
                }
            )
        finally:
            trainer.shutdown()
        placed.append({"backend": backend, "workers": workers})
    pool.clear()
    _wait_all_free()
    return placed


def _start_half_cpu_spread():
    from polytrain.launchers.worker_group import RayWorkerGroup

    group = RayWorkerGroup(
        num_workers=2,
        num_cpus_per_worker=0.5,
        placement_strategy="SPREAD",
        start_timeout_s=60,
        preload=(),
    )
    group.start()
    return group


def run_race(repeats: int = 3) -> list[dict]:
    """A SPREAD group of half-CPU workers (no pooled group serves it) placed right after stops.

    "idle": two idle SPREAD groups fill both worker nodes and yield to it. "terminated":
    two groups that fill them are stopped outside the pool (``terminate()``, as after a
    failure) just before. Ray gives each node's bundles back at its own moment.
    """
    from polytrain.launchers.pool import warm_pool as pool

    pool.configure(enabled=True)
    runs = []
    for _ in range(repeats):
        for case in ("idle", "terminated"):
            first, second = _start("SPREAD"), _start("SPREAD")
            for group in (first, second):
                if case == "idle":
                    group.shutdown()  # into the pool
                else:
                    group.terminate()
            idle = pool.idle_workers()
            other = _start_half_cpu_spread()
            runs.append(
                {"case": case, "idle_before": idle, "ips": [m.node_ip for m in other.metadata]}
            )
            other.shutdown()
            pool.clear()
            _wait_all_free()
    return runs


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
        for name, run in (("sequence", run_sequence), ("race", run_race)):
            try:
                result[name] = run()
            except Exception:  # noqa: BLE001 - reported to the test, which names it
                result[name] = {"error": traceback.format_exc()}
            print(f"[pool placement] {name}: {result[name]}", flush=True)
    finally:
        Path(out_path).write_text(json.dumps(result, indent=1))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
