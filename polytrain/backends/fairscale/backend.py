"""The fairscale backend: :class:`FairscaleConfig`, one process group, a strategy per mode."""

from __future__ import annotations

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.core.torch_distributed import TorchDistributedRendezvous
from polytrain.backends.fairscale.config import FairscaleConfig
from polytrain.backends.fairscale.strategy_fsdp import FairscaleFSDPStrategy
from polytrain.backends.fairscale.strategy_oss import FairscaleOSSStrategy
from polytrain.errors import ConfigError


class FairscaleBackend(Backend):
    """fairscale's OSS / ShardedDataParallel (CPU and GPU) or FullyShardedDataParallel (GPU)."""

    name = "fairscale"
    preload_modules = ("torch", "torch.distributed", "fairscale")
    framework = "torch"
    config_cls = FairscaleConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = FairscaleOSSStrategy
    config: FairscaleConfig
    accelerate_refusal = (
        "Accelerate has no fairscale mode (OSS + ShardedDataParallel or fairscale's FSDP), and "
        "the HF Trainer dropped its sharded_ddp option; torch's FSDP is fairscale's sharding "
        "upstreamed."
    )

    def validate_compile(self) -> None:
        """Driver: modes "sddp" and "oss" compile; "fsdp" (GPU only, untested) is refused.

        Raises:
            ConfigError: ``mode="fsdp"``.
        """
        if self.config.mode == "fsdp":
            raise ConfigError(
                "compile=True is not supported by the fairscale backend with mode='fsdp': "
                "fairscale's FullyShardedDataParallel flattens parameters like FSDP1 and "
                "polytrain has not verified it under torch.compile. Use mode 'sddp' or 'oss', "
                "or backend='fsdp' (version 2)."
            )

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: fairscale's FSDP needs CUDA.

        Raises:
            ConfigError: ``mode="fsdp"`` without ``use_gpu=True``.
        """
        if self.config.mode == "fsdp" and not use_gpu:
            raise ConfigError(
                "fairscale mode='fsdp' needs use_gpu=True: fairscale's FullyShardedDataParallel "
                "runs on CUDA only (got use_gpu=False). On CPU use backend='fsdp' (PyTorch's "
                "FullyShardedDataParallel, which also shards parameters and gradients), or "
                "fairscale mode 'sddp' or 'oss'."
            )

    def make_strategy(self) -> TorchStrategy:
        """Worker: the strategy of the configured mode ("fsdp", or OSS for "oss" / "sddp")."""
        if self.config.mode == "fsdp":
            return FairscaleFSDPStrategy(self.config)
        return FairscaleOSSStrategy(self.config)
