"""``DistributedDataParallel``'s signature across torch versions (ddp, fairscale, Lightning)."""

from __future__ import annotations

import functools
import inspect

from torch.nn.parallel import DistributedDataParallel


@functools.lru_cache(maxsize=1)
def ddp_parameters() -> tuple[str, ...]:
    """The keyword arguments of this torch's ``DistributedDataParallel.__init__``."""
    return tuple(inspect.signature(DistributedDataParallel.__init__).parameters)


def buffer_sync_kwargs(sync: bool) -> dict[str, bool]:
    """DDP keyword arguments for syncing buffers from rank 0 before each forward."""
    # torch >= 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers.
    if "forward_sync_buffers" in ddp_parameters():
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}
