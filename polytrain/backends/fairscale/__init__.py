"""fairscale sharded training: optimizer-state sharding (OSS), ShardedDataParallel, or FSDP on GPU.

Modes (``backend_config={"mode": ...}``):

* ``"oss"``: the optimizer state is partitioned over the ranks with
  ``fairscale.optim.OSS`` (ZeRO-1); gradients are all-reduced by plain
  ``DistributedDataParallel``.
* ``"sddp"`` (default): OSS plus ``ShardedDataParallel``, which reduces each
  gradient only to the rank that owns its optimizer shard (ZeRO-2).
* ``"fsdp"``: fairscale's ``FullyShardedDataParallel`` (parameters, gradients
  and optimizer state sharded). It runs on CUDA only; on CPU use
  ``backend="fsdp"`` (PyTorch's FSDP).

The user's optimizer is rebuilt as ``OSS`` with its class, defaults and param
groups (per-group options such as ``lr`` are kept); schedulers are pointed at
the new optimizer. Checkpoints are consolidated to plain torch format (see
:mod:`polytrain.backends.fairscale.state`): a state saved here loads into a
plain torch optimizer of the same class, and a plain torch state (e.g. from
``ddp``) loads here at any world size.

The driver side is :class:`~polytrain.backends.core.torch_distributed.TorchDistributedRendezvous`
(one gloo or nccl process group). The worker side is one of two strategies, chosen by
the mode in ``backend.py``: :class:`~.strategy_oss.FairscaleOSSStrategy` ("oss", "sddp")
or :class:`~.strategy_fsdp.FairscaleFSDPStrategy` ("fsdp"); what both need (which
optimizer belongs to which model, ``no_sync``) is in ``common.py``, shared by composition.
Importing this package imports no optional framework.

"""

from polytrain.backends.fairscale.config import MODES, FairscaleConfig

__all__ = ["MODES", "FairscaleConfig"]
