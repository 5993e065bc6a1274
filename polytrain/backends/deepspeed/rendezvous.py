"""The driver side of the deepspeed backend: one ``torch.distributed`` process group.

Over Ray workers this is the process group every ``torch.distributed`` backend
uses. In local mode (``num_workers=0``) the one worker is the driver process,
and DeepSpeed still wants a process group and the torchrun variables: the
rendezvous gives it a world of size 1 there, and undoes both on shutdown (a
process group the caller started is used and left alone). No framework is
imported at module level: the functions run in the worker import torch.
"""

from __future__ import annotations

import datetime
import functools
import os
from typing import TYPE_CHECKING

from polytrain.backends.core.torch_distributed import (
    TorchDistributedRendezvous,
    default_dist_backend,
)
from polytrain.backends.deepspeed.env import forget_deepspeed_groups
from polytrain.launchers.worker import find_free_port

if TYPE_CHECKING:
    from polytrain.backends.core.context import WorkerContext
    from polytrain.launchers.base import WorkerGroup

# Environment DeepSpeed reads in a local-mode (driver) worker; restored on shutdown.
_LOCAL_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")

# What a local-mode start changed: the environment before it, and whether it
# created the default process group (and shutdown must destroy it).
_LocalState = tuple[dict[str, "str | None"], bool]


def _start_local_process_group(dist_backend: str, timeout_s: float) -> _LocalState:
    """Local-mode worker: a size-1 process group and the torchrun variables for DeepSpeed."""
    import torch.distributed as dist

    saved = {key: os.environ.get(key) for key in _LOCAL_ENV_KEYS}
    if dist.is_initialized():  # the caller's own group: use it, leave it alone
        os.environ.setdefault("LOCAL_RANK", "0")
        return saved, False
    port = find_free_port()
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
        }
    )
    dist.init_process_group(
        backend=dist_backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return saved, True


def _stop_local_process_group(saved: dict[str, str | None], created: bool) -> None:
    """Local-mode worker: undo :func:`_start_local_process_group`."""
    import torch.distributed as dist

    try:
        forget_deepspeed_groups()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class DeepSpeedRendezvous(TorchDistributedRendezvous):
    """Driver side of ``deepspeed``: the workers' process group (size 1 in local mode).

    Args:
        config: the backend's :class:`~polytrain.backends.deepspeed.config.DeepSpeedConfig`
            (its ``dist_backend``: None for nccl on GPU, gloo on CPU).
    """

    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        self._local: _LocalState | None = None

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        """Driver: one process group over all workers (world size 1 in local mode)."""
        if not ctx.local_mode:
            super().on_start(group, ctx)
            return
        dist_backend = getattr(self.config, "dist_backend", None)
        self._local = group.execute_single(
            0,
            _start_local_process_group,
            dist_backend or default_dist_backend(ctx.use_gpu),
            ctx.timeout_s,
        )

    def on_shutdown(self, group: WorkerGroup) -> None:
        """Driver: destroy the process groups (dead workers are fine); restore local env."""
        if self._local is None:
            if getattr(group, "torchrun", None) is not None:
                # One process, later trainers in it: DeepSpeed's cached sub-groups go first.
                group.execute_best_effort(forget_deepspeed_groups)
            super().on_shutdown(group)
            return
        saved, created = self._local
        self._local = None
        group.execute_best_effort(functools.partial(_stop_local_process_group, saved, created))
