"""The worker side of the ddp backend: the user's models in ``DistributedDataParallel``."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.core.torch_distributed import module_device_ids
from polytrain.backends.ddp.config import DDPConfig


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
            model, device_ids=module_device_ids(ctx), **self.config.wrap_kwargs()
        )

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: DDP's ``no_sync`` on every wrapped model."""
        stack = contextlib.ExitStack()
        for model in components.models:
            if isinstance(model, DistributedDataParallel):
                stack.enter_context(model.no_sync())
        return stack
