"""The ddp backend: :class:`DDPConfig`, the process-group rendezvous and :class:`DDPStrategy`."""

from __future__ import annotations

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.torch_distributed import TorchDistributedRendezvous
from polytrain.backends.ddp.config import DDPConfig
from polytrain.backends.ddp.strategy import DDPStrategy
from polytrain.errors import ConfigError


class DDPBackend(Backend):
    """Data parallelism with ``DistributedDataParallel`` (gloo on CPU, nccl on GPU)."""

    name = "ddp"
    preload_modules = ("torch", "torch.distributed", "torch._dynamo")  # DDP() imports it
    framework = "torch"
    config_cls = DDPConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = DDPStrategy
    config: DDPConfig

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: nccl needs GPUs."""
        if self.config.dist_backend == "nccl" and not use_gpu:
            raise ConfigError("dist_backend='nccl' needs use_gpu=True; use 'gloo' on CPU.")
