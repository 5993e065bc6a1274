"""Run by test_parallelism.py in a fresh process: HSDP 2x2 on a simulated two-node cluster.

Usage: ``python parallel_script.py OUT.json [LAYOUT ...]`` with ``RAY_TMPDIR`` pointing at a
private directory (see tests/integration/fresh_cluster.py). The cluster: a head on
127.0.0.1 with 0 CPUs and two 2-CPU worker nodes on 127.0.0.2 and 127.0.0.3. A layout
is ``hsdp`` (``dp_replicate=2, dp_shard=2``, Llama) or ``tp_hsdp`` (``dp_replicate=2,
tp=2``, GPT-2: TP inside each node, the replicas across them). For each: the per-step
losses and gradient norms against the one-process reference, and every worker's node
and mesh groups. Written to OUT.json, errors as text.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(  # the raylets' workers import tests.integration
    [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
os.environ["POLYTRAIN_WARM_POOL"] = "0"

WORKER_IPS = ("127.0.0.2", "127.0.0.3")
LAYOUTS = {
    "hsdp": ("llama", {"dp_replicate": 2, "dp_shard": 2}),
    "tp_hsdp": ("gpt2", {"dp_replicate": 2, "tp": 2}),
}


def mesh_facts(operator) -> dict:
    """This worker's node, ranks and mesh groups (world ranks)."""
    import ray

    strategy = operator.strategy
    mesh = strategy.world_mesh(operator.context)
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "rank": operator.world_rank,
        "coordinates": list(strategy.coordinates),
        "groups": {dim: mesh[dim].mesh.tolist() for dim in ("dp_replicate", "dp_shard", "tp")},
    }


def check(layout: str) -> dict:
    from polytrain import TorchTrainer
    from tests.integration import parallel_models as lm

    model, parallelism = LAYOUTS[layout]
    trainer = TorchTrainer(
        model_creator=lm.CREATORS[model],
        data_creator=lm.data_creator,
        optimizer_creator=lm.sgd_creator,
        scheduler_creator=lm.scheduler_creator,
        config={"batch_size": lm.GLOBAL_BATCH},
        num_workers=4,
        backend="fsdp",
        parallelism=parallelism,
        max_grad_norm=lm.MAX_NORM,
        gradient_accumulation_steps=lm.ACCUMULATION,
        scaling_config={"placement_strategy": "SPREAD"},
        failure_config={"max_retries": 0},
    )
    try:
        stats = [trainer.train(num_steps=1) for _ in range(lm.STEPS)]
        facts = trainer.apply_all_operators(mesh_facts)
    finally:
        trainer.shutdown()
    _, losses, norms = lm.reference(model)
    return {
        "status": "ok",
        "losses": [s["loss"] for s in stats],
        "norms": [s["grad_norm"] for s in stats],
        "num_samples": stats[0]["num_samples"],
        "reference_losses": losses,
        "reference_norms": norms,
        "workers": facts,
    }


def main(out_path: str, layouts: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from polytrain.launchers.cluster.connect import ensure_ray

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for ip in WORKER_IPS:
        cluster.add_node(num_cpus=2, node_ip_address=ip)
    cluster.wait_for_nodes()
    result: dict = {}
    try:
        ensure_ray(cluster.address, timeout_s=60)
        for layout in layouts:
            try:
                result[layout] = check(layout)
            except Exception as exc:  # reported to the test, which names it
                result[layout] = {
                    "status": "error",
                    "error": "".join(traceback.format_exception(exc)),
                }
    finally:
        Path(out_path).write_text(json.dumps(result, indent=1))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(LAYOUTS))
    sys.stdout.flush()
    os._exit(0)
