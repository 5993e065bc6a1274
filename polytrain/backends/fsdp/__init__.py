"""PyTorch FSDP: parameters, gradients and optimizer state sharded.

``backend_config={"version": ...}`` picks torch's FSDP API: ``2`` (default) is
``fully_shard`` (FSDP2: every parameter a ``DTensor`` sharded on dim 0, mixed
precision by ``MixedPrecisionPolicy``; see :mod:`polytrain.backends.fsdp.strategy_v2`), ``1``
the legacy ``FullyShardedDataParallel`` class (FSDP1) with ``use_orig_params=True``,
which keeps the user's parameter objects as views of the local shard and needs
``device_id=torch.device("cpu")`` on CPU. Both train on CPU with gloo and on GPU
with nccl, and take the same :class:`FSDPConfig` (NO_SHARD and FSDP1's flags:
version 1 only). Optimizers are rebuilt over the sharded parameters with every
param group and per-group option.

Full checkpoints go through ``torch.distributed.checkpoint.state_dict``, the optimizer
state re-keyed from parameter names to indices (torch's ``optimizer.state_dict()``
format). Sharded directories are read and written range by range (:mod:`.state_v1`, :mod:`.state_v2`).

The driver side is :class:`~polytrain.backends.core.torch_distributed.TorchDistributedRendezvous`;
the worker side :class:`~.strategy_v2.FSDP2Strategy` (version 2) or
:class:`~.strategy_v1.FSDP1Strategy` (version 1), which share the optimizer and
checkpoint code by composition (:mod:`.common`). ``config.py`` holds the options
(imports only the backend contracts and errors), ``backend.py`` binds the parts.
Importing this package imports no optional framework.
"""

from polytrain.backends.fsdp.config import (
    AUTO_WRAP_POLICIES,
    FSDP_VERSIONS,
    SHARDING_STRATEGIES,
    FSDPConfig,
)

__all__ = ["AUTO_WRAP_POLICIES", "FSDP_VERSIONS", "SHARDING_STRATEGIES", "FSDPConfig"]
