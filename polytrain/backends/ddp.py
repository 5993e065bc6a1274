"""PyTorch DistributedDataParallel on ``torch.distributed``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.strategy import TorchStrategy
from polytrain.backends.torch_distributed import TorchDistributedRendezvous, module_device_ids
from polytrain.errors import ConfigError

_DIST_BACKENDS = ("gloo", "nccl", None)


@dataclass
class DDPConfig(BackendConfig):
    """Options of the ``ddp`` backend.

    Attributes:
        dist_backend: "gloo", "nccl", or None for nccl on GPU and gloo on CPU.
        find_unused_parameters: DDP's flag, for models whose forward skips parameters.
        gradient_as_bucket_view: DDP's memory-saving flag.
        static_graph: DDP's flag for graphs that do not change between steps.
        sync_buffers: sync buffers (e.g. BatchNorm stats) from rank 0 before every forward.
    """

    dist_backend: str | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    sync_buffers: bool = True

    def __post_init__(self) -> None:
        if self.dist_backend not in _DIST_BACKENDS:
            raise ConfigError(
                f"The provided dist_backend ({self.dist_backend!r}) is not supported. Must be "
                f"either 'gloo', 'nccl' or None (nccl on GPU, gloo on CPU)."
            )


class DDPStrategy(TorchStrategy):
    """Worker side of ``ddp``: every model with parameters wrapped in ``DistributedDataParallel``."""

    config: DDPConfig

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every model with parameters in DDP (not in local mode)."""
        if not dist.is_initialized():
            return components
        components.models = [self._wrap(model, ctx) for model in components.models]
        return components

    def _wrap(self, model: torch.nn.Module, ctx: WorkerContext) -> torch.nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model
        return DistributedDataParallel(
            model,
            device_ids=module_device_ids(ctx),
            find_unused_parameters=self.config.find_unused_parameters,
            gradient_as_bucket_view=self.config.gradient_as_bucket_view,
            static_graph=self.config.static_graph,
            **buffer_sync_kwargs(self.config.sync_buffers),
        )

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: DDP's ``no_sync`` on every wrapped model."""
        stack = contextlib.ExitStack()
        for model in components.models:
            if isinstance(model, DistributedDataParallel):
                stack.enter_context(model.no_sync())
        return stack


class DDPBackend(Backend):
    """Data parallelism with ``DistributedDataParallel`` (gloo on CPU, nccl on GPU)."""

    name = "ddp"
    framework = "torch"
    config_cls = DDPConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = DDPStrategy
    config: DDPConfig

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: nccl needs GPUs."""
        if self.config.dist_backend == "nccl" and not use_gpu:
            raise ConfigError("dist_backend='nccl' needs use_gpu=True; use 'gloo' on CPU.")


def buffer_sync_kwargs(sync: bool) -> dict[str, bool]:
    """DDP keyword arguments for syncing buffers from rank 0 before each forward."""
    # torch >= 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers.
    import inspect

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}
