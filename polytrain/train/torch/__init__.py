"""``polytrain.train.torch``: Ray Train's ``ray.train.torch``, on every polytrain torch backend.

Example (a Ray Train loop; only the imports differ)::

    from polytrain.train import ScalingConfig, report
    from polytrain.train.torch import TorchTrainer, prepare_model, prepare_data_loader

    def train_loop_per_worker(config):
        model = prepare_model(torch.nn.Linear(4, 1))
        ...
        report({"loss": loss.item()})

    result = TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=2),
                          backend="ddp").fit()
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import ConfigError
from polytrain.train.backend import BackendConfig
from polytrain.train.extras import apply_timeout
from polytrain.train.torch.checkpoint import TorchCheckpoint
from polytrain.train.torch.prepare import (
    accelerate,
    autocast,
    backward,
    clip_grad_norm_,
    enable_reproducibility,
    full_state_dict,
    get_device,
    get_devices,
    no_sync,
    prepare,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
    step,
    zero_grad,
)
from polytrain.train.trainer import DataParallelTrainer

__all__ = [
    "TorchCheckpoint",
    "TorchConfig",
    "TorchTrainer",
    "accelerate",
    "autocast",
    "backward",
    "clip_grad_norm_",
    "enable_reproducibility",
    "full_state_dict",
    "get_device",
    "get_devices",
    "no_sync",
    "prepare",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "step",
    "zero_grad",
]


class TorchConfig(BackendConfig):
    """The process group's options (Ray Train's ``TorchConfig``).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or None (nccl on GPU, gloo on CPU): the
            backend's ``dist_backend`` (ddp and deepspeed take it).
        init_method: ``"env"`` or ``"tcp"``; polytrain's rendezvous connects the group
            through a TCP store either way.
        timeout_s: the collective timeout (``FailureConfig.collective_timeout_s``).

    Raises:
        ConfigError: a value Ray Train refuses too.
    """

    def __init__(
        self, backend: str | None = None, init_method: str = "env", timeout_s: int = 1800
    ) -> None:
        if backend not in ("gloo", "nccl", None):
            raise ConfigError(
                f"TorchConfig(backend={backend!r}) must be 'gloo', 'nccl' or None (nccl on GPU, "
                f"gloo on CPU)."
            )
        if init_method not in ("env", "tcp"):
            raise ConfigError(
                f"The provided init_method ({init_method!r}) is not supported. Must be either "
                f"'env' or 'tcp'."
            )
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError(f"TorchConfig(timeout_s={timeout_s!r}) must be a number > 0.")
        self.backend = backend
        self.init_method = init_method
        self.timeout_s = timeout_s

    def to_polytrain(self) -> dict[str, Any] | None:
        """The backend config fields it sets (None: none)."""
        return {"dist_backend": self.backend} if self.backend is not None else None

    def __repr__(self) -> str:
        return (
            f"TorchConfig(backend={self.backend!r}, init_method={self.init_method!r}, "
            f"timeout_s={self.timeout_s!r})"
        )


class TorchTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on every worker of a torch backend (Ray Train's ``TorchTrainer``).

    Args are those of :class:`~polytrain.train.trainer.DataParallelTrainer`, plus Ray's
    ``torch_config`` (a :class:`TorchConfig`); ``backend`` is ``"ddp"`` by default and
    may be any polytrain torch backend (``horovod``, ``fairscale``, ``fsdp``,
    ``deepspeed``).

    Raises:
        ConfigError: ``torch_config`` together with ``backend_config``.
    """

    _default_backend = "ddp"

    def __init__(self, *args: Any, torch_config: TorchConfig | None = None, **kwargs: Any) -> None:
        if torch_config is not None:
            if not isinstance(torch_config, TorchConfig):
                raise ConfigError(
                    f"torch_config must be a polytrain.train.torch.TorchConfig; got "
                    f"{type(torch_config).__name__}: {torch_config!r}."
                )
            if kwargs.get("backend_config") is not None:
                raise ConfigError(
                    "TorchTrainer(torch_config=..., backend_config=...): give the process group's "
                    "options in one of them (TorchConfig(backend=...) is backend_config="
                    "{'dist_backend': ...})."
                )
            kwargs["backend_config"] = torch_config
        super().__init__(*args, **kwargs)
        if torch_config is not None:
            apply_timeout(self, torch_config.timeout_s, "TorchConfig")
