"""What an autoscaling Ray cluster can become, and whether a worker group can ever fit it.

Ray's autoscaler adds nodes of its node types (each up to its max count, all together up
to the cluster's ``max_workers``) when work asks for them. A request that no node type
can hold fails at once (:func:`judge_request`); one that some node type holds waits for
the autoscaler with a progress line on the driver (:func:`wait_for_nodes`). Only the
functions that read the connected cluster import Ray.

Where Ray 2.60 keeps the node types: autoscaler v2 may publish them in the GCS
(``ray._private.state.state.get_cluster_config()``); the default v1 autoscaler does not,
so the head's autoscaling config file is read, named on the command line of the monitor
process in the autoscaler's status: that works on the head (``polytrain submit`` jobs,
Slurm's batch host); elsewhere set ``POLYTRAIN_CLUSTER_CONFIG`` to the cluster file.
Estimates err towards waiting: unknown counts never make a request look impossible.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain.errors import InsufficientResourcesError
from polytrain.launchers.cluster.autoscaler_status import (  # re-exported: the readers' home is there
    autoscaler_runs,
    live_nodes,
    read_autoscaler_status,
)

#: Start timeouts without and with an autoscaler: a new cloud node boots and runs its
#: setup (examples/cluster: downloads and a Horovod build) before it joins.
START_TIMEOUT_S, AUTOSCALER_START_TIMEOUT_S = 30.0, 900.0
PROGRESS_EVERY_S = 20.0  # how often the driver prints a line while it waits
CLUSTER_CONFIG_ENV = "POLYTRAIN_CLUSTER_CONFIG"  # a cluster file to read node types from

_UNSEEN = (
    "an autoscaler whose node types are not readable from this process (set "
    "POLYTRAIN_CLUSTER_CONFIG to the cluster file to check requests against them)"
)
_HINTS = (
    "Lower the per-worker resources or add a larger node type.",
    "Set use_gpu=False or add a GPU node type.",
)


@dataclass(frozen=True)
class NodeType:
    """A worker node type the autoscaler may add (``max_workers`` None: no own limit)."""

    name: str
    resources: Mapping[str, float]  # per node; empty: the provider sets them at launch
    min_workers: int = 0
    max_workers: int | None = None


@dataclass(frozen=True)
class ClusterShape:
    """What the cluster can become: its worker node types and its node limit."""

    node_types: tuple[NodeType, ...]
    max_workers: int | None = None
    source: str = ""
    setup: Mapping[str, Any] = field(default_factory=dict, compare=False)
    visible: bool = True  # False: an autoscaler runs, its node types are not readable here

    def describe(self) -> str:
        """One line: ``cpu_node {CPU: 2} x 0-2, ... (at most 3 worker nodes)``."""
        if not self.visible:
            return "node types not readable from here"
        parts = [
            f"{t.name} {{{_fmt(t.resources) or 'resources set at launch'}}} x "
            f"{t.min_workers}-{'unlimited' if t.max_workers is None else t.max_workers}"
            for t in self.node_types
        ]
        limit = "" if self.max_workers is None else f" (at most {self.max_workers} worker nodes)"
        return (", ".join(parts) or "no worker node types") + limit


# ------------------------------------------------------------------ reading configs
def shape_from_config(config: Mapping[str, Any], source: str = "") -> ClusterShape:
    """The shape described by a cluster-launcher config or a KubeRay RayCluster/RayJob.

    A RayCluster goes through Ray's own KubeRay translation (what the KubeRay autoscaler
    sees). The head node type is left out: it is never added.
    """
    original = config
    if config.get("kind") in ("RayCluster", "RayJob"):
        config = _from_ray_cr(config)
    cap = config.get("max_workers")
    types = tuple(
        NodeType(
            name,
            {k: float(v) for k, v in (spec.get("resources") or {}).items()},
            int(spec.get("min_workers", 0)),
            _int_or_none(spec.get("max_workers", cap)),
        )
        for name, spec in (config.get("available_node_types") or {}).items()
        if name != config.get("head_node_type")
    )
    return ClusterShape(types, _int_or_none(cap), source, setup=original)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _from_ray_cr(manifest: Mapping[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    spec = manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]
    metadata = {"namespace": "default", **manifest.get("metadata", {})}
    return _derive_autoscaling_config_from_ray_cr({"metadata": metadata, "spec": spec})


def shape_from_gcs_config(cluster_config: Any, source: str = "GCS") -> ClusterShape:
    """The shape in an ``autoscaler_pb2.ClusterConfig`` (max_count -1: unlimited)."""
    return ClusterShape(
        tuple(
            NodeType(
                g.name, dict(g.resources), g.min_count, None if g.max_count < 0 else g.max_count
            )
            for g in cluster_config.node_group_configs
            if g.max_count != 0
        ),
        source=source,
    )


def node_setup_commands(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each node type's setup commands as the cluster launcher runs them.

    The head runs ``setup_commands + head_setup_commands``; a worker type runs its own
    ``worker_setup_commands`` when it has them (they *replace* the global list), else
    ``setup_commands + worker_setup_commands``. Without node types (an on-premise
    cluster) the result has a "head" and a "workers" entry.
    """
    common = list(config.get("setup_commands") or [])
    workers = common + list(config.get("worker_setup_commands") or [])
    head = config.get("head_node_type")
    types = config.get("available_node_types") or {"head": {}, "workers": {}}
    head = head if config.get("available_node_types") else "head"
    result = {}
    for name, spec in types.items():
        if name == head:
            result[name] = common + list(config.get("head_setup_commands") or [])
        else:
            result[name] = list(spec.get("worker_setup_commands", workers))
    return result


# ------------------------------------------------------------------ fitting
def bundles_per_node(resources: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` one node with ``resources`` holds."""
    counts = [
        math.floor(resources.get(name, 0.0) / amount + 1e-9)
        for name, amount in bundle.items()
        if amount > 0
    ]
    return max(0, min(counts)) if counts else 1 << 30


def _addable(shape: ClusterShape | Sequence[NodeType], live_counts: Mapping[str, int]):
    """[(node type, how many more nodes of it)], how many more nodes in all."""
    types = shape.node_types if isinstance(shape, ClusterShape) else tuple(shape)
    cap = shape.max_workers if isinstance(shape, ClusterShape) else None
    live = sum(live_counts.get(t.name, 0) for t in types)
    limit = lambda most, n: math.inf if most is None else max(0, most - n)  # noqa: E731
    return [(t, limit(t.max_workers, live_counts.get(t.name, 0))) for t in types], limit(cap, live)


def can_ever_fit(
    bundle: Mapping[str, float],
    count: int,
    live_nodes: Sequence[Mapping[str, float]],
    node_types: ClusterShape | Sequence[NodeType],
    strategy: str = "PACK",
    live_counts: Mapping[str, int] | None = None,
) -> tuple[bool, str]:
    """Whether ``count`` bundles can be placed once the autoscaler has added what it may.

    ``live_nodes`` are the alive nodes' total resources; ``node_types`` the autoscaler's
    worker node types (a :class:`ClusterShape` also carries the node limit);
    ``live_counts`` the alive nodes per type (unknown: none, which errs towards waiting).
    Returns ``(True, how)`` or ``(False, why not)``, naming live nodes and node types.
    """
    addable, cap = _addable(node_types, live_counts or {})
    live_fit = [bundles_per_node(n, bundle) for n in live_nodes]
    type_fit = [(t, _per_type(t, bundle), more) for t, more in addable]
    if not _enough(count, strategy, live_fit, type_fit, cap):
        return False, _why_not(bundle, count, strategy, live_fit, type_fit, cap)
    if _enough(count, strategy, live_fit, [], 0):
        return True, "fits the live nodes"
    return True, "fits once the autoscaler adds nodes"


def _enough(count: int, strategy: str, live_fit: list, type_fit: list, cap: float) -> bool:
    if strategy == "STRICT_PACK":
        return max([*live_fit, *(p for _, p, more in type_fit if more and cap)], default=0) >= count
    if strategy == "STRICT_SPREAD":
        added = min(cap, sum(more for _, p, more in type_fit if p >= 1))
        return sum(1 for n in live_fit if n >= 1) + added >= count
    return sum(live_fit) + _best_added(type_fit, cap) >= count


def _per_type(t: NodeType, bundle: Mapping[str, float]) -> float:
    # Undeclared resources: the provider fills them in at launch; assume the type fits.
    return math.inf if not t.resources else bundles_per_node(t.resources, bundle)


def _best_added(type_fit: list, cap: float) -> float:
    """The most bundles ``cap`` added nodes hold, the roomiest node types first."""
    total, left = 0.0, cap
    for _, per, more in sorted(type_fit, key=lambda x: -x[1]):
        if per <= 0 or left <= 0:
            break
        take = min(more, left)
        if take == math.inf:
            return math.inf
        total += per * take
        left -= take
    return total


def _why_not(bundle, count, strategy, live_fit, type_fit, cap) -> str:
    live = f"the {len(live_fit)} live node(s) hold {sum(live_fit)} worker(s) of {_fmt(bundle)}"
    if not type_fit:
        return f"{live} and no autoscaler node type can add more"
    types = ", ".join(
        f"{t.name} ({_fmt(t.resources)}) holds {'?' if p == math.inf else f'{p:g}'} per node, up to "
        f"{'unlimited' if more == math.inf else f'{more:g}'} more node(s)"
        for t, p, more in type_fit
    )
    limit = "" if cap == math.inf else f"; the cluster may add {cap:g} more node(s) in all"
    how = {"STRICT_PACK": " on one node", "STRICT_SPREAD": " on distinct nodes"}.get(strategy, "")
    return f"{count} worker(s){how} can never be placed: {live}; {types}{limit}"


def nodes_to_add(
    bundle: Mapping[str, float],
    count: int,
    free_nodes: Sequence[Mapping[str, float]],
    node_types: ClusterShape | Sequence[NodeType],
    live_counts: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """An estimate of the nodes per type the autoscaler must add (for progress lines)."""
    short = count - sum(bundles_per_node(n, bundle) for n in free_nodes)
    addable, cap = _addable(node_types, live_counts or {})
    plan: dict[str, int] = {}
    for t, more in sorted(addable, key=lambda x: -_per_type(x[0], bundle)):
        per = _per_type(t, bundle)
        while short > 0 and per > 0 and more > 0 and cap > 0:
            plan[t.name] = plan.get(t.name, 0) + 1
            short, more, cap = short - per, more - 1, cap - 1
    return plan


# ------------------------------------------------------------------ progress
def pending_from_status(status: Mapping[str, Any] | None) -> dict[str, int]:
    """Nodes per type the autoscaler is launching or starting, from its status JSON."""
    report = (status or {}).get("autoscaler_report") or {}
    pending: dict[str, int] = dict(report.get("pending_launches") or {})
    for entry in report.get("pending_nodes") or []:
        node_type = entry[1] if len(entry) > 1 else "node"
        pending[node_type] = pending.get(node_type, 0) + 1
    return pending


def live_counts_from_status(status: Mapping[str, Any] | None) -> dict[str, int]:
    """Alive nodes per node type, from the autoscaler's status JSON."""
    report = (status or {}).get("autoscaler_report") or {}
    return dict(report.get("active_nodes") or {})


def waiting_message(pending: Mapping[str, int], waited_s: float) -> str:
    """``waiting for 2 x cpu_node from the autoscaler, 40 s so far``."""
    what = " and ".join(f"{n} x {t}" for t, n in sorted(pending.items()) if n > 0)
    return f"waiting for {what or 'nodes'} from the autoscaler, {waited_s:.0f} s so far"


# ------------------------------------------------------------------ the driver's calls
def start_timeout(configured_s: float | None, shape: ClusterShape | None) -> float:
    """The user's start timeout, else minutes when an autoscaler may add nodes."""
    if configured_s is not None:
        return configured_s
    return START_TIMEOUT_S if shape is None else AUTOSCALER_START_TIMEOUT_S


def judge_request(
    bundle: Mapping[str, float], count: int, strategy: str, requested: str
) -> ClusterShape | None:
    """Driver: the cluster's shape when some node type can hold the request.

    Returns None when no autoscaler runs (judge the live nodes), and a shape with
    ``visible=False`` when one runs whose node types cannot be read from here.

    Raises:
        InsufficientResourcesError: at once, when no node type ever can.
    """
    shape = read_cluster_shape()
    if shape is None and autoscaler_runs():
        # Nodes may come, of types unknown here: wait for them rather than fail at once.
        return ClusterShape((), source=_UNSEEN, visible=False)
    if shape is None or not shape.visible:
        return shape
    counts = live_counts_from_status(read_autoscaler_status())
    ok, reason = can_ever_fit(bundle, count, live_nodes(), shape, strategy, counts)
    if not ok:
        raise InsufficientResourcesError(
            f"Requested {requested}, but {reason} (node types from {shape.source}). "
            + _HINTS[bool(bundle.get("GPU"))]
        )
    return shape


def wait_for_nodes(
    ready: Any,
    timeout_s: float,
    bundle: Mapping[str, float],
    count: int,
    shape: ClusterShape,
    log: Any = print,
    every_s: float = PROGRESS_EVERY_S,
) -> bool:
    """Driver: True once ``ready`` (a placement group's) is, False after ``timeout_s``;
    logs the autoscaler's progress meanwhile."""
    import ray

    start = time.monotonic()
    report_at = start + 1.0  # the first line once it is clear that nodes must start
    while (left := timeout_s - (time.monotonic() - start)) > 0:
        wait_s = min(left, max(0.05, report_at - time.monotonic()))
        if ray.wait([ready], timeout=wait_s)[0]:
            return True
        if time.monotonic() >= report_at:
            status = read_autoscaler_status()
            plan = pending_from_status(status) or nodes_to_add(
                bundle, count, live_nodes(), shape, live_counts_from_status(status)
            )
            log(waiting_message(plan, time.monotonic() - start))
            report_at += every_s
    return False


# ------------------------------------------------------------------ Ray readers
def read_cluster_shape(config_path: str | os.PathLike | None = None) -> ClusterShape | None:
    """What the connected cluster can become; None when no source is visible from here.

    Sources, first found wins: ``config_path`` (or ``$POLYTRAIN_CLUSTER_CONFIG``; a
    launcher YAML or a RayCluster manifest), the GCS cluster config, the autoscaling
    config file of the head's monitor process. A Ray Client driver (``ray://``) has
    no GCS connection of its own and runs off the head: only the first source.
    """
    import ray._private.state
    import yaml
    from ray.util.client import ray as ray_client

    path = config_path or os.environ.get(CLUSTER_CONFIG_ENV)
    if not path and ray_client.is_connected():
        return None
    if not path:
        gcs_config = ray._private.state.state.get_cluster_config()
        if gcs_config is not None and gcs_config.node_group_configs:
            return shape_from_gcs_config(gcs_config)
        path = _monitor_config_file(read_autoscaler_status())
    if path is None:
        return None
    return shape_from_config(yaml.safe_load(Path(path).expanduser().read_text()) or {}, str(path))


def _monitor_config_file(status: Mapping[str, Any] | None) -> Path | None:
    """The ``--autoscaling-config`` of the monitor named in the status, if it runs here."""
    import ray

    pid = (status or {}).get("monitor_pid")
    try:
        args = Path(f"/proc/{int(pid)}/cmdline").read_bytes().decode().split("\0")
    except (TypeError, ValueError, OSError):
        return None
    gcs = ray.get_runtime_context().gcs_address
    if not any("monitor" in a for a in args) or not any(a.endswith(gcs) for a in args):
        return None  # another process with that pid: the monitor runs on another host
    for i, arg in enumerate(args):
        if arg.startswith("--autoscaling-config"):
            value = arg.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "")
            file = Path(value).expanduser()
            return file if value and file.is_file() else None
    return None


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(
        f"{k}: {v / 2**30:.0f} GiB" if k.endswith("memory") else f"{k}: {v:g}"
        for k, v in sorted(resources.items())
        if not k.startswith("node:")
    )
