"""The driver side of the horovod backend: Horovod's gloo rendezvous on a worker group.

The driver runs Horovod's own HTTP rendezvous server
(:class:`horovod.runner.http.http_server.RendezvousServer`) and gives every
worker the environment ``horovodrun --gloo`` and ``horovod.ray`` give theirs
(``HOROVOD_RANK``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``, ...), with Horovod's ranks
equal to the worker group's world ranks; the workers then call ``hvd.init()``.

Like every rendezvous this module imports no framework at module level: Horovod
and Ray are imported inside the functions that need them (the functions sent to
the workers import Horovod there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.launchers.network import interface_with_address
from polytrain.launchers.process_env import single_arena_env

# The older private name, re-exported by backends/horovod.py.
_interface_with_address = interface_with_address

if TYPE_CHECKING:
    from polytrain.backends.core.context import WorkerContext
    from polytrain.backends.horovod.config import HorovodConfig
    from polytrain.launchers.base import WorkerGroup

logger = logging.getLogger(__name__)

# Seconds the driver waits for workers to shut Horovod down, and for the rendezvous
# server to stop, before it gives up on them (dead or stuck workers are killed next).
_SHUTDOWN_WAIT_S = 5.0


# ---------------------------------------------------------------- pure helpers
def host_assignments(node_ids: Sequence[str]) -> list[Any]:
    """Horovod's slot plan (``SlotInfo`` per world rank) for workers on ``node_ids``.

    ``node_ids`` is in world-rank order with co-located workers contiguous (as the
    worker group orders them). The node id doubles as Horovod's host name: it is
    unique per Ray node, unlike host names, and is what ``horovod.ray`` uses.
    """
    from horovod.runner.common.util import hosts

    slots: dict[str, int] = {}
    for node in node_ids:
        slots[node] = slots.get(node, 0) + 1
    host_string = ",".join(f"{node}:{count}" for node, count in slots.items())
    return hosts.get_host_assignments(hosts.parse_hosts(host_string), len(node_ids))


def horovod_env(
    slot: Any,
    rendezvous_addr: str,
    rendezvous_port: int,
    config: HorovodConfig,
    timeout_s: float,
) -> dict[str, str]:
    """The environment one worker needs for ``hvd.init()`` with the gloo controller.

    Args:
        slot: the worker's ``SlotInfo`` from :func:`host_assignments`.
        rendezvous_addr: an address of the driver that the worker can reach.
        rendezvous_port: the port of the driver's rendezvous server.
        config: the backend options (stall settings).
        timeout_s: gloo's timeout for rendezvous and collectives.
    """
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, int(timeout_s))),
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(config.stall_check_s)),
        "HOROVOD_STALL_CHECK_DISABLE": "1" if config.stall_check_s == 0 else "0",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(config.stall_shutdown_s)),
    }


def check_slots_match_ranks(slots: Sequence[Any], rank_infos: Sequence[Any]) -> None:
    """Raise if Horovod's slot plan disagrees with the worker group's ranks."""
    for slot, info in zip(slots, rank_infos, strict=True):
        mine = (info.world_rank, info.local_rank, info.world_size, info.local_world_size)
        theirs = (slot.rank, slot.local_rank, slot.size, slot.local_size)
        if mine != theirs:
            raise RuntimeError(
                f"Horovod's rank plan {theirs} (rank, local_rank, size, local_size) differs from "
                f"the worker group's {mine}; the workers of a node must have contiguous ranks."
            )


def _check_joined(rank_infos: Sequence[Any], joined: Sequence[tuple[int, int, int, int]]) -> None:
    """Raise if a worker joined Horovod at other ranks than the worker group gave it."""
    for info, (rank, size, local_rank, local_size) in zip(rank_infos, joined, strict=True):
        expected = (info.world_rank, info.world_size, info.local_rank, info.local_world_size)
        if (rank, size, local_rank, local_size) != expected:
            raise RuntimeError(
                f"Worker {info.world_rank} joined Horovod as rank {rank} of {size} (local "
                f"{local_rank} of {local_size}); expected {info}."
            )


# ------------------------------------------------ functions run in the workers
def _init_worker(
    env: dict[str, str], node_ip: str, use_gpu: bool = False
) -> tuple[int, int, int, int]:
    """Worker: set the Horovod environment and join the rendezvous (blocks for all ranks)."""
    import horovod.torch as hvd

    from polytrain.launchers.network import apply_socket_ifname_env

    os.environ.update(env)
    # gloo binds to the interface that carries the address Ray reaches this node on:
    # that one routes to the other nodes. Interface names may differ between hosts, so
    # the lookup runs here; an interface the user set (HOROVOD_GLOO_IFACE, ...) is kept.
    apply_socket_ifname_env(node_ip, use_gpu)
    from polytrain.launchers.pool.reset import register_reset_hook

    if hvd.is_initialized():  # a reused process: join the new group instead
        hvd.shutdown()
    hvd.init()
    # A warm worker handed to another group shuts Horovod down first (the pool's reset).
    register_reset_hook(_shutdown_worker)
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()


def _init_local() -> bool:
    """Local-mode worker: ``hvd.init()`` with size 1 unless Horovod runs already.

    Returns:
        True when this call initialised Horovod (and shutdown must undo it); False
        when the caller had started Horovod itself, which is then used and left alone.
    """
    import horovod.torch as hvd

    if hvd.is_initialized():
        return False
    hvd.init()
    return True


def _shutdown_worker() -> None:
    import horovod.torch as hvd

    if hvd.is_initialized():
        hvd.shutdown()


def _stop_server(server: Any) -> None:
    server.stop()
    # RendezvousServer.stop() leaves the listening socket open.
    httpd = getattr(server, "_httpd", None)
    if httpd is not None:
        httpd.server_close()


# ------------------------------------------------------------------ rendezvous
class HorovodRendezvous(Rendezvous):
    """Driver side of ``horovod``: the rendezvous server, every worker's env and ``hvd.init()``.

    One instance per worker group; it holds the driver's rendezvous server, which
    never travels to the workers. In local mode (``num_workers=0``) the single
    worker is the driver process: it runs ``hvd.init()`` with size 1, with no
    server and no environment change.

    Args:
        config: the backend's :class:`~polytrain.backends.horovod.config.HorovodConfig`.
    """

    config: HorovodConfig

    def __init__(self, config: HorovodConfig) -> None:
        super().__init__(config)
        self._server: Any = None
        self._local_mode = False
        self._owns_local_init = False

    def worker_process_env(self) -> dict[str, str]:
        """Driver: one malloc arena per worker, as a horovodrun rank has in effect.

        See :mod:`polytrain.launchers.process_env`.
        """
        return single_arena_env()

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: start the rendezvous server, give every worker its env, run ``hvd.init()``.

        In local mode ``hvd.init()`` runs in the one (in-process) worker with size 1
        and no environment is changed; a Horovod the user started is used as it is.
        """
        self.refuse_torchrun(
            group,
            "horovod",
            "Start the script with horovodrun, or leave torchrun and set num_workers.",
        )
        self._local_mode = ctx.local_mode
        if self._local_mode:
            self._owns_local_init = bool(group.execute_single(0, _init_local))
            return
        import ray
        from horovod.runner.http.http_server import RendezvousServer

        slots = host_assignments([m.node_id for m in group.metadata])
        check_slots_match_ranks(slots, group.rank_infos)
        server = RendezvousServer(verbose=0)
        port = server.start()
        self._server = server
        server.init(slots)
        addr = ray.util.get_node_ip_address()
        refs = [
            group.execute_single_async(
                rank,
                _init_worker,
                horovod_env(slot, addr, port, self.config, ctx.timeout_s),
                group.metadata[rank].node_ip,
                ctx.use_gpu,
            )
            for rank, slot in enumerate(slots)
        ]
        _check_joined(group.rank_infos, group.get(refs))

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: shut Horovod down in every worker and stop the rendezvous server.

        Waits at most a few seconds: dead workers, or workers stuck in a collective
        with a dead peer, are left to the worker group, which kills them.
        """
        try:
            if not self._local_mode:
                group.execute_best_effort(_shutdown_worker, timeout_s=_SHUTDOWN_WAIT_S)
            elif self._owns_local_init:
                self._owns_local_init = False
                group.execute_best_effort(_shutdown_worker, timeout_s=_SHUTDOWN_WAIT_S)
        except Exception:  # noqa: BLE001 - dead workers must not stop the shutdown
            logger.debug("Horovod shutdown in the workers failed", exc_info=True)
        finally:
            server, self._server = self._server, None
            if server is not None:
                # Stopping joins the server's threads; never let that block the driver.
                stopper = threading.Thread(target=_stop_server, args=(server,), daemon=True)
                stopper.start()
                stopper.join(_SHUTDOWN_WAIT_S)
