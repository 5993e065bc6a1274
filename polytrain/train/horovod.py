"""``polytrain.train.horovod.HorovodTrainer``: Ray Train 1.x's Horovod trainer, on Horovod's gloo ring.

The backend's rendezvous runs ``hvd.init()`` on every worker before the loop
starts; the loop's own ``hvd.init()`` finds Horovod initialised and returns.
Wrap the optimizer yourself (``hvd.DistributedOptimizer`` and broadcasts, as in
Horovod's examples) or with :func:`polytrain.train.torch.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.backends.horovod.config import HorovodConfig as _PolytrainHorovodConfig
from polytrain.errors import ConfigError
from polytrain.train.extras import apply_timeout
from polytrain.train.trainer import DataParallelTrainer

__all__ = ["HorovodConfig", "HorovodTrainer"]


@dataclass
class HorovodConfig(_PolytrainHorovodConfig):
    """Ray Train's ``HorovodConfig``, on polytrain's horovod backend options.

    It is the backend's config (``compression``, ``backward_passes_per_step``, ``op``,
    ``stall_check_s``, ...) with Ray Train's fields: ``timeout_s`` (gloo's timeout,
    300 s as in Ray Train) becomes the collective timeout. Ray's ssh fields (``key``,
    ``ssh_port``, ``ssh_identity_file``, ``ssh_str``), ``nics`` and
    ``placement_group_timeout_s`` are refused when set: the ranks are Ray actors joined
    by gloo (no ssh), the interface follows the node's IP, placement waits
    ``ScalingConfig.start_timeout_s``.
    """

    nics: Any = None
    verbose: bool = True
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("nics", "key", "ssh_port", "ssh_identity_file", "ssh_str"):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"HorovodConfig({name}={getattr(self, name)!r}) is not supported: polytrain's "
                    f"Horovod ranks are Ray actors joined by gloo (no ssh); the interface follows "
                    f"the node's IP (set HOROVOD_GLOO_IFACE in worker_runtime_env to pick one)."
                )
        if self.placement_group_timeout_s != 100:
            raise ConfigError(
                f"HorovodConfig(placement_group_timeout_s={self.placement_group_timeout_s!r}): "
                f"use ScalingConfig(start_timeout_s=...) for how long placement may take."
            )
        if not isinstance(self.verbose, bool):
            raise ConfigError(f"HorovodConfig(verbose={self.verbose!r}) must be True or False.")


class HorovodTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on Horovod workers (``backend="horovod"``).

    Ray Train 1.x's ``horovod_config`` (a :class:`HorovodConfig`) is taken too.
    """

    _default_backend = "horovod"

    def __init__(
        self, *args: Any, horovod_config: HorovodConfig | None = None, **kwargs: Any
    ) -> None:
        if horovod_config is not None:
            if kwargs.get("backend_config") is not None:
                raise ConfigError(
                    "HorovodTrainer(horovod_config=..., backend_config=...): give Horovod's "
                    "options in one of them."
                )
            kwargs["backend_config"] = horovod_config
        super().__init__(*args, **kwargs)
        if isinstance(self.backend_config, HorovodConfig):
            apply_timeout(self, self.backend_config.timeout_s, "HorovodConfig")
