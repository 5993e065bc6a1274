"""The driver side of the ``mwms`` backend: every worker's ``TF_CONFIG``.

:class:`TFConfigRendezvous` asks the workers for free ports, builds each
worker's ``TF_CONFIG`` with the pure function :func:`build_tf_config` and sets
it in the workers before they import TensorFlow (the strategy reads it when it
is created). It imports no framework: the functions it sends to the workers
only touch sockets and the environment.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.compat import quiet
from polytrain.compat.keras import LEGACY_KERAS_ENV
from polytrain.errors import ConfigError
from polytrain.launchers.worker import find_free_port

if TYPE_CHECKING:
    from polytrain.backends.core.context import WorkerContext
    from polytrain.launchers.base import WorkerGroup


# ------------------------------------------------------------ pure functions
def format_address(host: str, port: int) -> str:
    """``host:port`` for a TF_CONFIG cluster entry (IPv6 hosts in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def build_tf_config(addresses: Sequence[str], index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``index`` in a cluster of ``addresses``.

    Every process is a ``"worker"``; with no ``"chief"`` task in the cluster,
    TensorFlow makes worker 0 the chief (it writes summaries and checkpoints).

    Args:
        addresses: ``host:port`` of every worker, in world-rank order.
        index: this worker's world rank.

    Raises:
        ConfigError: no addresses, a repeated address, or an index out of range.
    """
    addresses = list(addresses)
    if not addresses:
        raise ConfigError("A TF_CONFIG cluster needs at least one worker address; got none.")
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise ConfigError(
            f"Worker addresses must be unique; {duplicates} appear more than once in "
            f"{addresses}. Every worker needs its own port."
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
        raise ConfigError(
            f"Worker index {index!r} is out of range for a cluster of {len(addresses)} "
            f"worker(s); must be 0 <= index < {len(addresses)}."
        )
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}


def is_chief(tf_config: dict[str, Any]) -> bool:
    """True for the process TensorFlow treats as chief under this ``TF_CONFIG``."""
    task = tf_config.get("task", {})
    if task.get("type") == "chief":
        return True
    return (
        task.get("type") == "worker"
        and task.get("index") == 0
        and "chief" not in tf_config.get("cluster", {})
    )


def plan_ports(node_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Which worker asks for how many ports, per node: ``{node_id: (first_rank, count)}``.

    One worker per node reserves all of its node's ports at once, so co-located
    workers can never be handed the same port.
    """
    plan: dict[str, tuple[int, int]] = {}
    for rank, node in enumerate(node_ids):
        first, count = plan.get(node, (rank, 0))
        plan[node] = (first, count + 1)
    return plan


def worker_env(
    addresses: Sequence[str], index: int, gpu_ids: Sequence[str] = (), use_gpu: bool = False
) -> dict[str, str]:
    """The environment of worker ``index``: its ``TF_CONFIG`` and, on GPU, only its own GPU.

    Each worker sees just its own GPU: MultiWorkerMirroredStrategy would otherwise
    make a local replica on every GPU it sees.

    Raises:
        ConfigError: ``use_gpu`` is set but the worker was given no GPU.
    """
    env = {"TF_CONFIG": json.dumps(build_tf_config(addresses, index))}
    if use_gpu:
        if not gpu_ids:
            raise ConfigError(
                f"use_gpu=True but worker {index} was given no GPU by Ray; set use_gpu=False "
                f"or add GPU nodes."
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


# --------------------------------------------------- functions run in workers
def _free_ports(count: int) -> list[int]:
    # Hold every socket until all are bound, so the ports are distinct.
    if count == 1:
        return [find_free_port()]
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


def _connect_worker(env: dict[str, str]) -> None:
    """Worker: take the cluster's environment, then import TensorFlow (quietly unless verbose).

    TensorFlow reads ``TF_CONFIG`` when the strategy is created, not on import, so
    importing here is safe; it keeps the C++ runtime's start-up lines, written
    before its log level applies, out of the driver's console.
    """
    _set_env(env)
    quiet.install()
    quiet.quiet_import_tensorflow()


# ----------------------------------------------------------------- rendezvous
def cluster_addresses(group: WorkerGroup) -> list[str]:
    """Driver: ``host:port`` of every worker of ``group``, in rank order, on free ports.

    One worker per node reserves the ports of all workers on its node (see
    :func:`plan_ports`).
    """
    node_ids = [meta.node_id for meta in group.metadata]
    plan = plan_ports(node_ids)
    refs = {
        node: group.execute_single_async(first, _free_ports, count)
        for node, (first, count) in plan.items()
    }
    ports: list[int] = [0] * len(node_ids)
    for node, ref in refs.items():
        node_ports = iter(group.get([ref], ranks=[plan[node][0]])[0])
        for rank, rank_node in enumerate(node_ids):
            if rank_node == node:
                ports[rank] = next(node_ports)
    return [
        format_address(meta.node_ip, port) for meta, port in zip(group.metadata, ports, strict=True)
    ]


class TFConfigRendezvous(Rendezvous):
    """Driver side of ``tf.distribute`` multi-worker strategies: ``TF_CONFIG`` per worker.

    Workers start with ``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is then tf_keras,
    see :mod:`polytrain.compat.keras`); :meth:`on_start` gives each its
    ``TF_CONFIG`` and, on GPU, only its own GPU. Nothing to release on shutdown.
    """

    def worker_env_vars(self) -> dict[str, str]:
        """Driver: every worker starts with ``TF_USE_LEGACY_KERAS=1`` (before TensorFlow loads).

        Unless ``POLYTRAIN_VERBOSE`` is set, also with TensorFlow's C++ logging turned
        down (``TF_CPP_MIN_LOG_LEVEL``; see :mod:`polytrain.compat.quiet`).
        """
        return {**LEGACY_KERAS_ENV, **quiet.worker_env()}

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: give every worker its ``TF_CONFIG`` (and, on GPU, only its own GPU).

        Runs before any worker imports TensorFlow: the strategy reads ``TF_CONFIG``
        when it is created, and collective ops must be configured before TensorFlow's
        runtime starts. Local mode needs no cluster.
        """
        self.refuse_torchrun(
            group,
            "mwms",
            "Run the script as one process (python script.py), or set num_workers.",
        )
        if ctx.local_mode:
            return
        addresses = cluster_addresses(group)
        refs = [
            group.execute_single_async(
                rank,
                _connect_worker,
                worker_env(addresses, rank, group.metadata[rank].gpu_ids, ctx.use_gpu),
            )
            for rank in range(len(addresses))
        ]
        group.get(refs)
