"""Process-group plumbing shared by the backends built on ``torch.distributed``.

:class:`TorchDistributedRendezvous` is the driver side of ddp, fairscale, fsdp and
deepspeed: it imports no framework; the functions it sends to the workers import
torch there.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

from polytrain.backends.context import WorkerContext
from polytrain.backends.rendezvous import Rendezvous
from polytrain.launchers.ranks import torch_distributed_env
from polytrain.launchers.worker import find_free_port

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup

# True in a process whose default process group polytrain created: only that one is
# destroyed on shutdown (in local mode the driver may hold a process group of its own).
_created_here = False


def _init_process_group(
    backend: str,
    init_method: str,
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
    _created_here = True
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _destroy_process_group() -> None:
    import torch.distributed as dist

    global _created_here
    if _created_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False


def default_dist_backend(use_gpu: bool) -> str:
    """nccl on GPU, gloo on CPU."""
    return "nccl" if use_gpu else "gloo"


def start_process_group(
    group: WorkerGroup, ctx: WorkerContext, dist_backend: str | None = None
) -> None:
    """Driver: initialise one ``torch.distributed`` process group across the workers.

    Rank 0's host and a free port on it are the rendezvous; every worker also gets
    the torchrun environment (MASTER_ADDR, RANK, LOCAL_RANK, ...), which libraries
    such as DeepSpeed read. Local mode (one in-process worker) starts none.
    """
    if ctx.local_mode:
        return
    dist_backend = dist_backend or default_dist_backend(ctx.use_gpu)
    master_addr = group.metadata[0].node_ip
    master_port = group.execute_single(0, find_free_port)
    init_method = f"tcp://{master_addr}:{master_port}"
    refs = [
        group.execute_single_async(
            rank,
            _init_process_group,
            dist_backend,
            init_method,
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

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: one process group over all workers (none in local mode)."""
        start_process_group(group, ctx, getattr(self.config, "dist_backend", None))

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: destroy the process groups (dead workers are fine)."""
        stop_process_group(group)
