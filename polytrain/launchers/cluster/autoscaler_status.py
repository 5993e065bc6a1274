"""What the GCS says about a cluster's autoscaler: its status, whether one runs, the live nodes.

Readable from any driver of the cluster (unlike the head's config file, which
:func:`polytrain.launchers.cluster.autoscaler.read_cluster_shape` needs): these tell that an
autoscaler *runs* even where its node types cannot be seen, e.g. a driver on a KubeRay
head container, whose autoscaler runs in a sidecar with its own process namespace.
"""

from __future__ import annotations

import json
from typing import Any

_STATUS_KEY = "__autoscaling_status"  # ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS


def read_autoscaler_status() -> dict[str, Any] | None:
    """The autoscaler's status JSON in the GCS (None: no autoscaler has reported)."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_STATUS_KEY)
    return json.loads(raw) if raw else None


def autoscaler_runs() -> bool:
    """Whether an autoscaler that can add nodes serves the connected cluster.

    Every Ray cluster runs a monitor that reports a status; without an autoscaling
    config it only watches (Ray's read-only node provider), and then it names each
    node's type after the node (``node_<node id>``). A type of any other name comes
    from a config's node types: nodes can be added. Autoscaler v2 says so in the GCS.
    """
    status = read_autoscaler_status()
    mapping = ((status or {}).get("autoscaler_report") or {}).get("node_type_mapping") or {}
    if any(kind != f"node_{node}" for node, kind in mapping.items()):
        return True
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        return bool(is_autoscaler_v2(fetch_from_server=True))
    except Exception:  # noqa: BLE001 - an older or newer Ray without this check: assume none
        return False


def live_nodes() -> list[dict[str, float]]:
    """Total resources of every alive node."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
