"""Options of the ``fairscale`` backend (what ``backend_config=`` accepts)."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.backends.core.backend import BackendConfig
from polytrain.errors import ConfigError

MODES = ("oss", "sddp", "fsdp")


@dataclass
class FairscaleConfig(BackendConfig):
    """Options of the ``fairscale`` backend.

    Attributes:
        mode: "sddp" (OSS + ShardedDataParallel, default), "oss" (OSS + DDP) or "fsdp"
            (fairscale FullyShardedDataParallel, GPU only).
        broadcast_buffers: sync buffers (e.g. BatchNorm statistics) from rank 0 before
            every forward pass.
        reduce_buffer_size: ShardedDataParallel's gradient bucket size in elements
            (0 disables bucketing); "sddp" only.
        reshard_after_forward: free the gathered parameters after the forward pass
            (ZeRO-3; False keeps them until backward, ZeRO-2 style); "fsdp" only.
    """

    mode: str = "sddp"
    broadcast_buffers: bool = True
    reduce_buffer_size: int = 2**23
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"The provided mode ({self.mode!r}) is not supported. Must be one of "
                f"{', '.join(repr(m) for m in MODES)}: 'oss' (optimizer-state sharding + DDP), "
                f"'sddp' (OSS + ShardedDataParallel) or 'fsdp' (FullyShardedDataParallel, GPU "
                f"only)."
            )
        if self.reduce_buffer_size < 0:
            raise ConfigError(
                f"reduce_buffer_size must be >= 0 (elements; 0 disables bucketing); got "
                f"{self.reduce_buffer_size!r}."
            )
