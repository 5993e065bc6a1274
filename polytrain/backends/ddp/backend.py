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
    accelerate_refusal = None  # DDP is Accelerate's own multi-process mode

    def accelerate_env(self, use_gpu: bool) -> dict[str, str]:
        """Nothing beyond ranks and devices: Accelerate trains with DDP by default.

        Raises:
            ConfigError: a DDP flag of ``backend_config`` is set; Accelerate takes its DDP
                arguments from the script, not from the environment.
        """
        flags = {
            name: value
            for name, value in vars(self.config).items()
            if name != "dist_backend" and value not in (None, {})
        }
        if flags:
            raise ConfigError(
                f"backend_config {flags} cannot reach Accelerate's DDP wrap, which takes its "
                f"arguments from the script: drop them from backend_config and set them there "
                f"(TrainingArguments(ddp_find_unused_parameters=..., ddp_bucket_cap_mb=..., "
                f"ddp_broadcast_buffers=..., ddp_static_graph=...) for the HF Trainer, "
                f"Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)]) otherwise)."
            )
        return {}

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: nccl needs GPUs."""
        if self.config.dist_backend == "nccl" and not use_gpu:
            raise ConfigError("dist_backend='nccl' needs use_gpu=True; use 'gloo' on CPU.")
