"""The chaos run's simulated cluster: a ``ray.cluster_utils.Cluster`` on loopback addresses, and its processes.

Worker nodes come and go under the fault schedule (removed, drained, replaced);
:func:`live_actors_and_groups`, :func:`process_state` and :func:`processes_left`
tell what is still alive in the cluster and on this host once the drivers are gone.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.chaos.schedule import NUM_WORKERS


def live_actors_and_groups(job_id: str | None = None, wait_s: float = 20.0) -> dict[str, list[str]]:
    """Actors not dead (of ``job_id``, or of every job) and placement groups not removed.

    Waits up to ``wait_s`` for them to go: a shutdown's clean-up takes a moment.
    """
    import ray
    from ray._private import state

    deadline = time.monotonic() + wait_s
    while True:
        actors = [
            f"{a['ActorClassName']} {a['ActorID'][:12]} {a['State']} pid {a.get('Pid')}"
            for a in state.actors().values()
            if a["State"] != "DEAD" and (job_id is None or a["JobID"] == job_id)
        ]
        groups = [
            f"{pg['placement_group_id'][:12]} {pg['state']}"
            for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"
        ]
        if (not actors and not groups) or time.monotonic() > deadline:
            return {"actors": actors, "placement_groups": groups}
        time.sleep(0.5)


class SimCluster:
    """A ``ray.cluster_utils.Cluster``: a CPU-less head and two 2-CPU worker nodes at a time.

    Lost or drained nodes are replaced at once by a node on a fresh loopback address
    (as an autoscaler would), so the group can always restart at full size.
    """

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        from polytrain.launchers.cluster.connect import ensure_ray

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        self._next_ip = 2
        self.nodes: dict[str, Any] = {}  # node id -> ray._private.node.Node (worker nodes)
        for _ in range(NUM_WORKERS):
            self.add_node()
        self.cluster.wait_for_nodes()
        ensure_ray(self.cluster.address, timeout_s=60)
        self.address = self.cluster.address

    def add_node(self) -> str:
        """Start a 2-CPU worker node on the next loopback address; returns its node id."""
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        node = self.cluster.add_node(num_cpus=2, node_ip_address=ip)
        self.nodes[node.node_id] = node
        return node.node_id

    def remove(self, node_id: str, graceful: bool) -> None:
        """Kill a worker node's processes (raylet, workers)."""
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self.cluster.remove_node(node, allow_graceful=graceful)

    def drain(self, node_id: str, deadline_s: float | None) -> list[Any]:
        """Announce a preemption of the node as ``ray drain-node`` does; ``[accepted, reason]``."""
        import ray
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
        deadline_ms = (
            0 if deadline_s is None else time.time_ns() // 1_000_000 + int(deadline_s * 1000)
        )
        return list(
            gcs.drain_node(
                node_id,
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "polytrain chaos run",
                deadline_ms,
            )
        )

    @staticmethod
    def alive_nodes() -> set[str]:
        """Ids of the nodes the GCS sees alive."""
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    @staticmethod
    def leftovers(wait_s: float = 20.0) -> dict[str, list[str]]:
        """Actors not dead and placement groups not removed, in the whole cluster (after up to ``wait_s``)."""
        return live_actors_and_groups(None, wait_s)

    def shutdown(self) -> None:
        """Disconnect and stop every node this cluster started."""
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, T (stopped), Z (zombie), ...) or None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def processes_left(pids: dict[int, Any], wait_s: float = 20.0) -> list[int]:
    """The worker processes of ``pids`` still running after up to ``wait_s`` (zombies count as gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(pid for pid in pids if process_state(pid) not in (None, "Z"))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
