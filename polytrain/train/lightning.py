"""``polytrain.train.lightning``: Ray Train's Lightning names, for a ``pl.Trainer`` inside ``train_loop_per_worker``.

The loop builds its Lightning trainer as with Ray Train::

    def train_loop_per_worker(config):
        trainer = pl.Trainer(
            devices="auto", accelerator="auto",
            strategy=RayDDPStrategy(),
            plugins=[RayLightningEnvironment()],
            callbacks=[RayTrainReportCallback()],
        )
        trainer = prepare_trainer(trainer)
        trainer.fit(model)

Lightning's own DDP / FSDP / DeepSpeed strategies then run on the process group the
trainer's polytrain backend has connected (``TorchTrainer(..., backend="ddp")``; for
DeepSpeed ``backend="deepspeed"`` or ``"ddp"``): :class:`RayLightningEnvironment`
(polytrain's :class:`~polytrain.lightning.WorkerGroupEnvironment`) gives Lightning the
worker's ranks, the strategies its device and sampler split, and
:class:`RayTrainReportCallback` reports Lightning's metrics with a
``checkpoint.ckpt`` at every epoch end. To launch the workers from a ``pl.Trainer`` on
the driver instead (ray_lightning's way), use :class:`polytrain.lightning.RayStrategy`.

Importing this module imports pytorch_lightning.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from polytrain.errors import ConfigError
from polytrain.lightning.environment import WorkerGroupEnvironment
from polytrain.train import session as train_session
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.reporting import CheckpointUploadMode

__all__ = [
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayTrainReportCallback",
    "prepare_trainer",
]


def _device() -> torch.device:
    return train_session.current("lightning strategy").worker_context.device


class _WorkerPlacement:
    """The worker's device and sampler split (Ray Train's strategies' two overrides)."""

    @property
    def root_device(self) -> torch.device:
        """The worker's device (``polytrain.train.torch.get_device()``)."""
        return _device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One share of the data per worker."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class RayDDPStrategy(_WorkerPlacement, pl.strategies.DDPStrategy):
    """Lightning's ``DDPStrategy`` on the worker group's process group (Ray Train's)."""


class RayFSDPStrategy(_WorkerPlacement, pl.strategies.FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on the worker group's process group (Ray Train's)."""


class RayDeepSpeedStrategy(_WorkerPlacement, pl.strategies.DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` on the worker group's process group (Ray Train's)."""


class RayLightningEnvironment(WorkerGroupEnvironment):
    """Lightning's cluster environment of a ``polytrain.train`` worker: its ranks from ``get_context()``."""

    def __init__(self) -> None:
        super().__init__()

    def world_size(self) -> int:
        """The number of workers."""
        return train_session.get_context().get_world_size()

    def global_rank(self) -> int:
        """This worker's world rank."""
        return train_session.get_context().get_world_rank()

    def local_rank(self) -> int:
        """This worker's rank on its node."""
        return train_session.get_context().get_local_rank()

    def node_rank(self) -> int:
        """The rank of this worker's node."""
        return train_session.get_context().get_node_rank()

    def teardown(self) -> None:
        """Nothing: the worker group owns the processes and the process group."""


_STRATEGIES = (RayDDPStrategy, RayFSDPStrategy, RayDeepSpeedStrategy)


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Check a ``pl.Trainer`` built in the loop for a polytrain worker group; returns it.

    Raises:
        ConfigError: a strategy that is not one of this module's, another cluster
            environment, or a backend that connected no torch process group (horovod,
            mwms): use ``backend="ddp"`` (or ``"deepspeed"``, ``"fsdp"``).
    """
    if not isinstance(trainer.strategy, _STRATEGIES):
        raise ConfigError(
            f"Invalid strategy class: {type(trainer.strategy).__name__}. Inside "
            f"train_loop_per_worker the strategy must be one of "
            f"{[cls.__name__ for cls in _STRATEGIES]} (polytrain.train.lightning) or a subclass."
        )
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, RayLightningEnvironment):
        raise ConfigError(
            f"Invalid cluster environment plugin {type(environment).__name__}: pass "
            f"plugins=[polytrain.train.lightning.RayLightningEnvironment()] to pl.Trainer."
        )
    world = train_session.get_context().get_world_size()
    if world > 1 and not torch.distributed.is_initialized():
        raise ConfigError(
            "prepare_trainer: this worker group has no torch process group (its backend is not "
            "a torch DDP-style one, e.g. horovod). Use TorchTrainer(..., backend='ddp'), "
            "'deepspeed' or 'fsdp' for Lightning's strategies."
        )
    return trainer


class RayTrainReportCallback(pl.callbacks.Callback):
    """Reports ``trainer.callback_metrics`` and a ``checkpoint.ckpt`` at every epoch end (Ray Train's).

    Each report's checkpoint directory holds Lightning's full checkpoint
    (``trainer.save_checkpoint``) as ``checkpoint.ckpt``; the metrics are the callback
    metrics plus ``epoch`` and ``step``.

    Args:
        checkpoint_upload_mode: a :class:`~polytrain.train.CheckpointUploadMode` (SYNC).
        validation: validate each checkpoint with the trainer's ``validation_config``.
    """

    CHECKPOINT_NAME = "checkpoint.ckpt"

    def __init__(
        self, checkpoint_upload_mode: CheckpointUploadMode | None = None, validation: Any = False
    ) -> None:
        super().__init__()
        self.checkpoint_upload_mode = checkpoint_upload_mode or CheckpointUploadMode.SYNC
        self.validation = validation
        context = train_session.get_context()
        self.tmpdir_prefix = Path(
            tempfile.gettempdir(),
            f"lightning_checkpoints-{os.getpid()}-name={context.get_experiment_name()}"
            f"-world_rank={context.get_world_rank()}",
        ).as_posix()
        shutil.rmtree(self.tmpdir_prefix, ignore_errors=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save Lightning's checkpoint and report it with the epoch's metrics."""
        tmpdir = Path(self.tmpdir_prefix, str(trainer.current_epoch)).as_posix()
        os.makedirs(tmpdir, exist_ok=True)
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        metrics["epoch"] = trainer.current_epoch
        metrics["step"] = trainer.global_step
        trainer.save_checkpoint(Path(tmpdir, self.CHECKPOINT_NAME).as_posix(), weights_only=False)
        train_session.report(
            metrics,
            checkpoint=Checkpoint.from_directory(tmpdir),
            checkpoint_upload_mode=self.checkpoint_upload_mode,
            validation=self.validation,
        )
        trainer.strategy.barrier()
        if not self.checkpoint_upload_mode.default_delete_local_checkpoint_after_upload():
            shutil.rmtree(tmpdir, ignore_errors=True)
