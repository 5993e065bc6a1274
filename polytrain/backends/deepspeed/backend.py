"""The deepspeed backend: :class:`DeepSpeedConfig`, the process-group rendezvous and :class:`DeepSpeedStrategy`."""

from __future__ import annotations

import copy
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.parallelism import Parallelism
from polytrain.backends.core.step_options import StepOptions
from polytrain.backends.core.strategy import Strategy
from polytrain.backends.deepspeed.config import DeepSpeedConfig, apply_step_options
from polytrain.backends.deepspeed.env import mlflow_hidden, preserved_env
from polytrain.backends.deepspeed.parallelism import check_mesh, with_mesh
from polytrain.backends.deepspeed.rendezvous import DeepSpeedRendezvous
from polytrain.backends.deepspeed.strategy import DeepSpeedStrategy
from polytrain.backends.deepspeed.strategy_tp import AutoTPStrategy
from polytrain.errors import ConfigError


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO data parallelism (stages 0-3); gloo on CPU, nccl on GPU.

    One model and one optimizer per trainer: DeepSpeed's engine wraps exactly one
    of each. The trainer keeps stepping the user's scheduler (per batch, per epoch
    or manually, as ``scheduler_step_freq`` says): it changes the learning rate in
    the param groups that the DeepSpeed optimizer steps. With
    ``gradient_accumulation_steps > 1`` every training batch is one micro-batch
    and a "batch" scheduler step happens per micro-batch.
    """

    name = "deepspeed"
    preload_modules = ("torch", "torch.distributed", "deepspeed")
    framework = "torch"
    config_cls = DeepSpeedConfig
    rendezvous_cls = DeepSpeedRendezvous
    strategy_cls = DeepSpeedStrategy
    config: DeepSpeedConfig
    accelerate_refusal = None

    def accelerate_env(self, use_gpu: bool) -> dict[str, str]:
        """Accelerate's DeepSpeed plugin with this backend's config (:mod:`.accelerate_env`)."""
        from polytrain.backends.deepspeed.accelerate_env import deepspeed_accelerate_env

        return deepspeed_accelerate_env(self.config, use_gpu)

    def validate_step_options(self, step: StepOptions) -> None:
        """Driver: the DeepSpeed config must not set other accumulation or clipping."""
        super().validate_step_options(step)
        apply_step_options(self.config.resolved(), step)

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: offload and nccl need GPUs; the DeepSpeed config must parse.

        Raises:
            ConfigError: naming the setting and what to do instead.
        """
        offloads = self.config.offloads()
        if offloads and not use_gpu:
            raise ConfigError(
                f"DeepSpeed {' and '.join(offloads)} moves state from the GPU to the CPU and "
                f"needs use_gpu=True; got use_gpu=False. On CPU everything already lives in "
                f"host memory: drop {', '.join(offloads)} (ZeRO stages 1-3 still shard the "
                f"state across workers)."
            )
        if self.config.dist_backend == "nccl" and not use_gpu:
            raise ConfigError("dist_backend='nccl' needs use_gpu=True; use 'gloo' on CPU.")
        with preserved_env(), mlflow_hidden():
            _validate_with_deepspeed(self.config.resolved())

    def accept_parallelism(self, sizes: Parallelism, tp_plan: Any) -> Any:
        """Driver: ``tp`` as AutoTP, ``dp_replicate`` x ``dp_shard`` as ZeRO++ hpZ (stage 3).

        See :mod:`polytrain.backends.deepspeed.parallelism`.

        Raises:
            ConfigError: what DeepSpeed cannot run, with the reason.
        """
        check_mesh(sizes, tp_plan, self.config.zero_stage)
        with_mesh(self.config, sizes)  # a DeepSpeed config that disagrees fails here
        return None

    def make_strategy(self) -> Strategy:
        """Worker: the engine's strategy, with the mesh's DeepSpeed sections when one is set."""
        if self.parallelism is None:
            return super().make_strategy()
        config = with_mesh(self.config, self.parallelism)
        if self.parallelism.tp > 1:
            return AutoTPStrategy(config, self.parallelism.tp)
        return self.strategy_cls(config)


def _validate_with_deepspeed(ds_config: dict[str, Any]) -> None:
    """Parse the config with DeepSpeed's own validators (nested keys, types, removed keys)."""
    from deepspeed.runtime.config import DeepSpeedConfig as _DSConfig

    probe = copy.deepcopy(ds_config)
    steps = int(probe.get("gradient_accumulation_steps", 1))
    # Batch sizes are filled in on the workers; any consistent values parse here.
    probe.setdefault("train_micro_batch_size_per_gpu", 1)
    probe.setdefault("train_batch_size", probe["train_micro_batch_size_per_gpu"] * steps)
    try:
        _DSConfig(probe)
    except Exception as exc:  # DeepSpeed raises pydantic, assertion and value errors
        raise ConfigError(
            f"DeepSpeed rejected the config {ds_config!r}: {type(exc).__name__}: {exc}. Fix the "
            f"named key (see https://www.deepspeed.ai/docs/config-json/)."
        ) from None
