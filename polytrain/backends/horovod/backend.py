"""The horovod backend: :class:`HorovodConfig`, :class:`HorovodRendezvous` and :class:`HorovodStrategy`."""

from __future__ import annotations

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.step_options import StepOptions
from polytrain.backends.horovod.config import HorovodConfig
from polytrain.backends.horovod.rendezvous import (
    HorovodRendezvous,
    _interface_with_address,  # noqa: F401 - re-exported: the driver-side interface lookup
)
from polytrain.backends.horovod.strategy import HorovodStrategy
from polytrain.errors import ConfigError


class HorovodBackend(Backend):
    """Data parallelism with Horovod's ring-allreduce and ``hvd.DistributedOptimizer``.

    The workers are the worker group's actors; the driver hosts Horovod's gloo
    rendezvous server (on the :class:`HorovodRendezvous`, one per worker group:
    the backend itself holds only its config and travels to the workers). Models
    stay unwrapped (Horovod hooks the optimizer), so checkpoints are plain torch
    state dicts that load under any backend.
    """

    name = "horovod"
    preload_modules = ("torch", "torch.distributed", "horovod.torch")
    framework = "torch"
    config_cls = HorovodConfig
    rendezvous_cls = HorovodRendezvous
    strategy_cls = HorovodStrategy
    config: HorovodConfig
    accelerate_refusal = (
        "Horovod reduces gradients in its own DistributedOptimizer over its own gloo "
        "context, with no torch.distributed process group; Accelerate has no Horovod mode, "
        "so an Accelerator() or HF Trainer here would see one process per worker and train "
        "each worker alone."
    )

    #: Stage GPU tensors through host memory even if Horovod can handle CUDA tensors.
    force_host_staging: bool = False

    def validate_step_options(self, step: StepOptions) -> None:
        """Driver: one way of accumulating: the trainer's or Horovod's, not both."""
        super().validate_step_options(step)
        if step.accumulates and self.config.backward_passes_per_step > 1:
            raise ConfigError(
                f"gradient_accumulation_steps={step.gradient_accumulation_steps} and the horovod "
                f"backend's backward_passes_per_step={self.config.backward_passes_per_step} would "
                f"accumulate twice. Drop backward_passes_per_step from backend_config: the "
                f"trainer's keyword holds Horovod's allreduce back on the first k-1 batches."
            )

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: refuse Adasum, which Horovod runs only over MPI (this backend uses gloo).

        Raises:
            ConfigError: ``op="adasum"``.
        """
        if self.config.op == "adasum":
            raise ConfigError(
                "The provided op ('adasum') is not supported by the horovod backend: Horovod "
                "implements Adasum only on top of MPI (launched by horovodrun/mpirun), and "
                "polytrain's workers rendezvous through Horovod's gloo controller ('No Adasum "
                "operation enabled'). Use op='average' (the default) or op='sum'."
            )

    def make_strategy(self) -> HorovodStrategy:
        """Worker: a :class:`HorovodStrategy` that honours :attr:`force_host_staging`."""
        return HorovodStrategy(self.config, force_host_staging=self.force_host_staging)
