"""PyTorch DDP options (what ``backend_config=`` accepts) and the DDP-argument checks."""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from polytrain.backends.core.backend import BackendConfig
from polytrain.backends.core.ddp_signature import buffer_sync_kwargs, ddp_parameters
from polytrain.errors import ConfigError, ConfigTypeError

_DIST_BACKENDS = ("gloo", "nccl", None)

#: DDP arguments that polytrain sets itself in every worker, with what sets them.
RESERVED_DDP_KWARGS = {
    "self": "",
    "module": "the model your creator or LightningModule builds in each worker",
    "device_ids": "the worker's device, from use_gpu / num_gpus_per_worker",
    "output_device": "the worker's device, from use_gpu / num_gpus_per_worker",
    "process_group": "the default process group that polytrain's rendezvous starts",
    "device_mesh": "the default process group that polytrain's rendezvous starts",
    "delay_all_reduce_named_params": "the model's parameters, which exist only in the workers",
    "param_to_hook_all_reduce": "the model's parameters, which exist only in the workers",
}

#: DDPConfig's own flags and the DDP argument each one sets (sync_buffers: see buffer_sync_kwargs).
_FLAGS = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")
_BUFFER_KEYS = ("broadcast_buffers", "forward_sync_buffers")


@dataclass
class DDPConfig(BackendConfig):
    """Options of the ``ddp`` backend.

    Attributes:
        dist_backend: "gloo", "nccl", or None for nccl on GPU and gloo on CPU.
        find_unused_parameters: DDP's flag, for models whose forward skips parameters
            (None: DDP's default, False).
        gradient_as_bucket_view: DDP's memory-saving flag (None: DDP's default, False).
        static_graph: DDP's flag for graphs that do not change between steps (None: False).
        sync_buffers: sync buffers (e.g. BatchNorm stats) from rank 0 before every
            forward (DDP's ``broadcast_buffers``; None: DDP's default, True).
        ddp_kwargs: any other keyword argument of ``DistributedDataParallel`` (e.g.
            ``{"bucket_cap_mb": 50}``), checked against its signature in this torch.
            The arguments polytrain sets itself (``module``, ``device_ids``,
            ``process_group``, ...) are refused, and so is a key that one of the
            flags above sets too.
    """

    dist_backend: str | None = None
    find_unused_parameters: bool | None = None
    gradient_as_bucket_view: bool | None = None
    static_graph: bool | None = None
    sync_buffers: bool | None = None
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dist_backend not in _DIST_BACKENDS:
            raise ConfigError(
                f"The provided dist_backend ({self.dist_backend!r}) is not supported. Must be "
                f"either 'gloo', 'nccl' or None (nccl on GPU, gloo on CPU)."
            )
        for name in (*_FLAGS, "sync_buffers"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigTypeError(f"{name} must be True, False or None; got {value!r}.")
        check_ddp_kwargs(self.ddp_kwargs, "backend_config['ddp_kwargs']")
        self._check_flag_conflicts()

    def _check_flag_conflicts(self) -> None:
        flag_keys = {name: (name,) for name in _FLAGS}
        flag_keys["sync_buffers"] = _BUFFER_KEYS
        for name, keys in flag_keys.items():
            twice = [key for key in keys if key in self.ddp_kwargs]
            if getattr(self, name) is not None and twice:
                raise ConfigError(
                    f"DDP option set twice: {name}={getattr(self, name)!r} and ddp_kwargs "
                    f"{ {key: self.ddp_kwargs[key] for key in twice} }. Set it in one place."
                )

    def wrap_kwargs(self) -> dict[str, Any]:
        """Every keyword argument given to ``DistributedDataParallel``, but module and devices."""
        kwargs: dict[str, Any] = {
            name: getattr(self, name) for name in _FLAGS if getattr(self, name) is not None
        }
        if self.sync_buffers is not None:
            kwargs.update(buffer_sync_kwargs(self.sync_buffers))
        kwargs.update(self.ddp_kwargs)
        return kwargs


def ddp_options(**kwargs: Any) -> dict[str, Any]:
    """Driver: ``kwargs`` less those equal to DDP's own defaults (they change nothing).

    Its signature is DDP's user-settable keyword arguments, so that a strategy that
    passes its ``**ddp_kwargs`` here shows them to LightningCLI (jsonargparse follows
    ``**kwargs`` into the call); the CLI then passes every one, defaults included.
    Unknown keys are kept, for :func:`check_ddp_kwargs` to name.
    """
    defaults = {name: p.default for name, p in _user_signature().parameters.items()}
    return {
        key: value
        for key, value in kwargs.items()
        if key not in defaults or not _same(value, defaults[key])
    }


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


@functools.lru_cache(maxsize=1)
def _user_signature() -> inspect.Signature:
    params = inspect.signature(DistributedDataParallel.__init__).parameters.values()
    return inspect.Signature(
        [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in params
            if p.name not in RESERVED_DDP_KWARGS
        ],
        return_annotation=dict,
    )


ddp_options.__signature__ = _user_signature()  # type: ignore[attr-defined]


def check_ddp_kwargs(kwargs: Any, where: str) -> None:
    """Driver: raise unless ``kwargs`` are keyword arguments a user may give to DDP.

    Args:
        kwargs: the DDP keyword arguments.
        where: where they were given, for the message (``"RayStrategy(**ddp_kwargs)"``).

    Raises:
        ConfigTypeError: not a dict of names, a name that DDP does not take (with the
            valid names), or one that polytrain sets itself (saying what sets it).
    """
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise ConfigTypeError(
            f"{where} must be a dict of DistributedDataParallel keyword arguments, e.g. "
            f"{{'bucket_cap_mb': 50}}; got {type(kwargs).__name__}: {kwargs!r}."
        )
    allowed = [name for name in ddp_parameters() if name not in RESERVED_DDP_KWARGS]
    for key in kwargs:
        if key in RESERVED_DDP_KWARGS:
            raise ConfigTypeError(
                f"{where}: {key!r} cannot be given: polytrain sets it from "
                f"{RESERVED_DDP_KWARGS[key] or 'the model'}. Allowed DDP arguments: {allowed}."
            )
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigTypeError(
                f"{where}: {key!r} is not a keyword argument of "
                f"torch.nn.parallel.DistributedDataParallel in torch {torch.__version__}"
                f"{hint}. Valid ones: {allowed}."
            )
