"""Process-group plumbing shared by the backends built on ``torch.distributed``.

:class:`TorchDistributedRendezvous` is the driver side of ddp, fairscale, fsdp and
deepspeed: it imports no framework; the functions it sends to the workers import
torch there.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from typing import TYPE_CHECKING

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.launchers.process_env import single_arena_env
from polytrain.launchers.ranks import torch_distributed_env

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup

# True in a process whose default process group polytrain created: only that one is
# destroyed on shutdown (in local mode the driver may hold a process group of its own).
_created_here = False

# Rank 0's TCPStore server, kept alive as long as the process group that uses it.
_store_server = None


def _start_store(host: str, timeout_s: float) -> int:
    """Rank 0: start the rendezvous store on ``host`` and a port the OS picks; return that port.

    The store listens on ``host`` only (the address the group was given: 127.0.0.1 for
    a local run), not on every interface, which is where TCPStore binds a port it opens
    itself: this process binds the socket and hands it over (``master_listen_fd``; both
    of torch's server backends, libuv and the classic one, take it). Binding port 0 in
    the process that keeps the socket open leaves no window in which another process
    can take the port between "find a free port" and "listen on it".
    """
    from torch.distributed import TCPStore

    global _store_server
    _store_server = None  # a previous group's server (its group is gone by now)
    sock = _bound_socket(host)
    try:
        _store_server = TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now and closes it when it stops
    return int(_store_server.port)


def _bound_socket(host: str) -> socket.socket:
    """A TCP socket bound to ``host`` (IPv4 or IPv6) on a free port, not listening yet."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _init_process_group(
    backend: str,
    store_address: tuple[str, int],
    rank: int,
    world_size: int,
    timeout_s: float,
    env: dict[str, str],
    node_ip: str | None = None,
) -> None:
    import torch.distributed as dist

    from polytrain.launchers.network import apply_socket_ifname_env

    global _created_here
    os.environ.update(env)
    if node_ip is not None:
        # gloo (and NCCL's bootstrap) bind to the interface that holds the address Ray
        # reaches this node at, not to whatever the host name resolves to.
        apply_socket_ifname_env(node_ip, use_gpu=backend == "nccl")
    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0 and _store_server is not None:
        store = _store_server
    else:
        host, port = store_address
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _created_here = True
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


def join_torchrun_process_group(
    dist_backend: str, timeout_s: float, device_index: int | None = None
) -> None:
    """Worker: the default process group over torchrun's world (``init_method="env://"``).

    What local mode does in a process that torchrun started: torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) name the world, and its store
    the rendezvous. A process group the caller already started is used as it is.
    The group stays for the life of the process (destroyed at exit), and later
    trainers in the process use it: torch names a re-created default group as it
    named the first, and the ranks of a second rendezvous under the same names in
    torchrun's store could read the first one's stale addresses and hang.

    Args:
        dist_backend: "nccl" or "gloo".
        timeout_s: the timeout of one collective.
        device_index: the CUDA device to bind first (NCCL's communicators bind the
            current device); None on CPU.
    """
    import torch
    import torch.distributed as dist

    if device_index is not None:
        torch.cuda.set_device(device_index)
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=dist_backend,
        init_method="env://",
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    global _created_here, _store_server
    if _created_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False
    _store_server = None


def default_dist_backend(use_gpu: bool) -> str:
    """nccl on GPU, gloo on CPU."""
    return "nccl" if use_gpu else "gloo"


def start_process_group(
    group: WorkerGroup, ctx: WorkerContext, dist_backend: str | None = None
) -> None:
    """Driver: initialise one ``torch.distributed`` process group across the workers.

    Rank 0 starts the rendezvous store on a port its OS picks (no free-port race),
    the others connect to it; every worker also gets the torchrun environment
    (MASTER_ADDR, RANK, LOCAL_RANK, ...) with that address, which libraries such as
    DeepSpeed read. Local mode (one in-process worker) starts none, unless torchrun
    started the process: then the worker joins torchrun's process group.
    """
    dist_backend = dist_backend or default_dist_backend(ctx.use_gpu)
    world = getattr(group, "torchrun", None)  # a LocalWorkerGroup under torchrun
    if world is not None:
        device = world.local_rank if ctx.use_gpu else None
        group.execute(join_torchrun_process_group, dist_backend, ctx.timeout_s, device)
        return
    if ctx.local_mode:
        return
    master_addr = group.metadata[0].node_ip
    master_port = group.execute_single(0, _start_store, master_addr, ctx.timeout_s)
    refs = [
        group.execute_single_async(
            rank,
            _init_process_group,
            dist_backend,
            (master_addr, master_port),
            info.world_rank,
            info.world_size,
            ctx.timeout_s,
            torch_distributed_env(info, master_addr, master_port),
            group.metadata[rank].node_ip,
        )
        for rank, info in enumerate(group.rank_infos)
    ]
    group.get(refs)


def stop_process_group(group: WorkerGroup) -> None:
    """Driver: destroy the process groups; tolerate dead workers."""
    group.execute_best_effort(_destroy_process_group, timeout_s=5.0)


def module_device_ids(ctx: WorkerContext) -> list[int] | None:
    """Worker: ``device_ids`` for DDP-style wrappers: the worker's GPU, or None on CPU."""
    if ctx.device.type == "cuda":
        import torch

        return [ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()]
    return None


class TorchDistributedRendezvous(Rendezvous):
    """Driver side of the backends built on ``torch.distributed``: one default process group.

    Uses ``config.dist_backend`` when the backend's config has one (None: nccl on
    GPU, gloo on CPU).
    """

    def worker_process_env(self) -> dict[str, str]:
        """Driver: one malloc arena per worker, as a torchrun rank has in effect.

        See :mod:`polytrain.launchers.process_env`.
        """
        return single_arena_env()

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: one process group over all workers (none in local mode)."""
        start_process_group(group, ctx, getattr(self.config, "dist_backend", None))

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: destroy the process groups (dead workers are fine)."""
        stop_process_group(group)
