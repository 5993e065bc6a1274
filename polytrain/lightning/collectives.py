"""Lightning's collectives for the Ray strategies, over ``torch.distributed``.

``self.log(sync_dist=True)``, torchmetrics and Lightning's barriers talk through
``torch.distributed`` whatever the backend uses for gradients: the launcher makes
sure a process group exists even when the backend talks through something else
(Horovod).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _sync_ddp_if_available,
)
from lightning_fabric.utilities.distributed import group as _group
from torch import Tensor


class TorchCollectives:
    """Mixin of a Lightning ``ParallelStrategy``: reduce, barrier, broadcast, all_gather.

    Each call is a no-op outside an initialised process group (on the driver).
    """

    root_device: torch.device

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Worker: all-reduce a tensor across the workers (mean by default)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Worker: wait until every worker arrives."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Worker: send a picklable object from rank ``src`` to every worker."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Worker: gather a tensor from every worker."""
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
