"""The fsdp backend: :class:`FSDPConfig`, one process group, a strategy per version."""

from __future__ import annotations

from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.parallelism import Parallelism, refuse_mesh
from polytrain.backends.core.strategy import Strategy
from polytrain.backends.core.torch_distributed import TorchDistributedRendezvous
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.backends.fsdp.strategy_mesh import MeshFSDPStrategy
from polytrain.backends.fsdp.strategy_v1 import FSDP1Strategy
from polytrain.backends.fsdp.strategy_v2 import FSDP2Strategy
from polytrain.backends.fsdp.tp_plans import check_tp_plan
from polytrain.errors import ConfigError


class FSDPBackend(Backend):
    """PyTorch FSDP: ``fully_shard`` (FSDP2, default) or ``FullyShardedDataParallel`` (gloo / nccl)."""

    name = "fsdp"
    preload_modules = ("torch", "torch.distributed", "torch.distributed.fsdp")
    config_cls = FSDPConfig
    rendezvous_cls = TorchDistributedRendezvous
    strategy_cls = FSDP2Strategy
    config: FSDPConfig
    accelerate_refusal = None

    def accelerate_env(self, use_gpu: bool) -> dict[str, str]:
        """Accelerate's FSDP plugin with this backend's options (:mod:`.accelerate_env`)."""
        from polytrain.backends.fsdp.accelerate_env import fsdp_accelerate_env

        return fsdp_accelerate_env(self.config, use_gpu)

    def validate_compile(self) -> None:
        """Driver: FSDP2 compiles after ``fully_shard``; FSDP1 is refused.

        Raises:
            ConfigError: ``version=1``.
        """
        if self.config.version == 1:
            raise ConfigError(
                "compile=True is not supported by the fsdp backend with version=1: "
                "FullyShardedDataParallel flattens parameters into its own FlatParameter, "
                "which torch.compile follows only with use_orig_params=True, and polytrain "
                "compiles FSDP2 only. Use version 2 (the default) or drop compile."
            )

    def accept_parallelism(self, sizes: Parallelism, tp_plan: Any) -> Any:
        """Driver: any mesh on version 2 (HSDP, TP, TP x FSDP); the ``tp_plan`` checked.

        Raises:
            ConfigError: version 1, or a ``tp_plan`` with an unknown style.
        """
        if self.config.version == 1:
            raise refuse_mesh(
                "fsdp",
                sizes,
                "version 1 (FullyShardedDataParallel) has no device mesh here; "
                "remove 'version': 1 from backend_config (version 2, fully_shard, is the default)",
            )
        return check_tp_plan(tp_plan)

    def make_strategy(self) -> Strategy:
        """Worker: :class:`~polytrain.backends.fsdp.strategy_v2.FSDP2Strategy` (version 2),
        :class:`~polytrain.backends.fsdp.strategy_mesh.MeshFSDPStrategy` (a ``parallelism``
        mesh) or :class:`~polytrain.backends.fsdp.strategy_v1.FSDP1Strategy`."""
        if self.parallelism is not None:
            return MeshFSDPStrategy(self.config, self.parallelism, self.tp_plan)
        if self.config.version == 1:
            return FSDP1Strategy(self.config)
        return FSDP2Strategy(self.config)
