"""TorchTrainer: train PyTorch creators on any torch backend with one flag."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from polytrain.backends.base import Backend
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.ranks import split_batch_size
from polytrain.trainer_api import torch_worker
from polytrain.trainer_api.config import (
    SCHEDULER_STEP_FREQS,
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
)
from polytrain.trainer_api.creators import TorchCreators
from polytrain.trainer_api.operator import TrainingOperator
from polytrain.trainer_api.results import reduce_worker_stats
from polytrain.trainer_api.trainer import BaseTrainer

#: The parts of a checkpoint dict the workers load (the rest is the envelope).
_STATE_KEYS = ("models", "optimizers", "schedulers", "scaler", "operator", "global_step")


def _operator_class(
    training_operator_cls: type[TrainingOperator] | None, scheduler_step_freq: str
) -> type[TrainingOperator]:
    """Check the options of the training step; return the operator class to use."""
    if scheduler_step_freq not in SCHEDULER_STEP_FREQS:
        raise ConfigError(
            f"scheduler_step_freq={scheduler_step_freq!r} is not supported. Must be one of "
            f"{SCHEDULER_STEP_FREQS}."
        )
    operator_cls = training_operator_cls or TrainingOperator
    if not (isinstance(operator_cls, type) and issubclass(operator_cls, TrainingOperator)):
        raise ConfigTypeError(
            f"training_operator_cls must be a subclass of polytrain.TrainingOperator; got "
            f"{operator_cls!r}."
        )
    return operator_cls


class TorchTrainer(BaseTrainer):
    """Train a PyTorch model on Ray workers with any torch backend.

    Example:
        >>> trainer = TorchTrainer(
        ...     model_creator=lambda config: torch.nn.Linear(64, 10),
        ...     data_creator=digits_creator,
        ...     optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=config["lr"]),
        ...     loss_creator=torch.nn.CrossEntropyLoss,
        ...     config={"lr": 0.1, "batch_size": 64},
        ...     num_workers=2, backend="ddp")
        >>> stats = trainer.train()
        >>> trainer.save("ckpt.pt"); trainer.shutdown()

    Args:
        model_creator: ``config -> nn.Module`` (or a tuple of modules).
        data_creator: ``config -> train_loader`` or ``(train_loader, val_loader)``. It is
            called on every worker with ``config["batch_size"]`` set to the per-worker
            batch: the global ``batch_size // num_workers`` (the remainder is dropped,
            with a warning). A ``DistributedSampler`` is added to the loaders unless
            ``add_dist_sampler=False``.
        optimizer_creator: ``(model, config) -> Optimizer`` (or a tuple); gets the tuple
            of models when ``model_creator`` returns several.
        loss_creator: a loss class (``torch.nn.CrossEntropyLoss``) or ``config -> callable``.
        scheduler_creator: ``(optimizer, config) -> scheduler``, optional.
        training_operator_cls: a :class:`TrainingOperator` subclass for custom steps.
        config: the user's hyperparameters; ``batch_size`` is the global batch.
        num_workers: shortcut for ``scaling_config.num_workers`` (0 = local mode).
        use_gpu: shortcut for ``scaling_config.use_gpu``.
        num_cpus_per_worker: shortcut for ``scaling_config.num_cpus_per_worker``.
        backend: a backend name or alias (see :func:`polytrain.available_backends`) or a
            :class:`~polytrain.backends.Backend` instance.
        backend_config: the backend's typed config, or a dict of its fields.
        use_fp16: mixed precision (fp16 + GradScaler on GPU, bf16 autocast on CPU).
        use_tqdm: show rank 0's progress as a bar on the driver.
        scheduler_step_freq: "batch", "epoch" or "manual" (your operator steps it).
        add_dist_sampler: give the loaders a distributed sampler.
        check_finite_loss: raise at the first NaN/inf loss, naming step and rank.
        scaling_config: :class:`ScalingConfig` (or dict): workers, resources, placement.
        failure_config: :class:`FailureConfig` (or dict): retries, hang detection.
        checkpoint_config: :class:`CheckpointConfig` (or dict): where checkpoints go.
    """

    framework = "torch"

    def __init__(
        self,
        *,
        model_creator: Callable[[dict], Any],
        data_creator: Callable[[dict], Any],
        optimizer_creator: Callable[[Any, dict], Any],
        loss_creator: Any = None,
        scheduler_creator: Callable[[Any, dict], Any] | None = None,
        training_operator_cls: type[TrainingOperator] | None = None,
        config: dict[str, Any] | None = None,
        num_workers: int | None = None,
        use_gpu: bool | None = None,
        num_cpus_per_worker: float | None = None,
        backend: str | Backend = "ddp",
        backend_config: Any = None,
        use_fp16: bool = False,
        use_tqdm: bool = False,
        scheduler_step_freq: str = "batch",
        add_dist_sampler: bool = True,
        check_finite_loss: bool = True,
        scaling_config: ScalingConfig | dict | None = None,
        failure_config: FailureConfig | dict | None = None,
        checkpoint_config: CheckpointConfig | dict | None = None,
    ) -> None:
        self.operator_cls = _operator_class(training_operator_cls, scheduler_step_freq)
        self.creators = TorchCreators(
            model_creator, data_creator, optimizer_creator, loss_creator, scheduler_creator
        )
        if loss_creator is None and self.operator_cls.train_batch is TrainingOperator.train_batch:
            raise ConfigError(
                "loss_creator is required by the default training step; pass one (e.g. "
                "torch.nn.CrossEntropyLoss) or a training_operator_cls that overrides train_batch."
            )
        super().__init__(
            backend=backend,
            backend_config=backend_config,
            config=config,
            num_workers=num_workers,
            use_gpu=use_gpu,
            num_cpus_per_worker=num_cpus_per_worker,
            scaling_config=scaling_config,
            failure_config=failure_config,
            checkpoint_config=checkpoint_config,
            use_fp16=use_fp16,
            use_tqdm=use_tqdm,
        )
        # Validates the global batch against the worker count (and warns on a remainder).
        self.worker_config = self._per_worker_config(self.config, self.scaling.num_workers)
        self.scheduler_step_freq = scheduler_step_freq
        self.add_dist_sampler = add_dist_sampler
        self.check_finite_loss = check_finite_loss
        self._start()

    @staticmethod
    def _per_worker_config(
        config: dict[str, Any], num_workers: int, warn: bool = True
    ) -> dict[str, Any]:
        """``config`` with ``batch_size`` (the global batch, already checked) split between workers."""
        worker_config = dict(config)
        if "batch_size" in config:
            global_batch = config["batch_size"]
            per_worker = split_batch_size(global_batch, num_workers)
            if warn and num_workers > 1 and global_batch % num_workers:
                warnings.warn(
                    f"batch_size={global_batch} does not divide by num_workers={num_workers}: "
                    f"each worker uses {per_worker}, so the effective global batch is "
                    f"{per_worker * num_workers}.",
                    stacklevel=3,
                )
            worker_config["batch_size"] = per_worker
        return worker_config

    # ------------------------------------------------------------- workers
    def _setup_workers(self, group: WorkerGroup) -> None:
        setup = torch_worker.WorkerSetup(
            creators=self.creators,
            operator_cls=self.operator_cls,
            backend=self.backend,
            config=self._per_worker_config(self.config, len(group), warn=False),
            context=self._context_template(),
            scheduler_step_freq=self.scheduler_step_freq,
            add_dist_sampler=self.add_dist_sampler,
            check_finite_loss=self.check_finite_loss,
        )
        refs = [
            group.execute_single_async(rank, torch_worker.setup_worker, setup, info, device)
            for rank, (info, device) in enumerate(
                zip(group.rank_infos, group.device_indices, strict=True)
            )
        ]
        group.get(refs)

    def _worker_state(self) -> dict[str, Any]:
        return self._run(torch_worker.get_state, self.epoch)[0]

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        payload = {key: state[key] for key in _STATE_KEYS if key in state}
        self._run(torch_worker.load_state, self._share(payload))

    # ------------------------------------------------------------ training
    def train(
        self, num_steps: int | None = None, info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Train one epoch (or ``num_steps`` batches) on every worker.

        Returns:
            Metrics reduced over workers, weighted by sample count: ``epoch``, ``loss``,
            ``num_samples``, ``num_steps``, ``samples_per_s``, ``epoch_time_s``,
            ``num_restarts``, ``num_workers``, ``checkpoint_path`` (with a
            ``checkpoint_dir``) and whatever a custom operator's ``train_batch`` returns.
        """
        epoch = self._begin_epoch()
        results = self._run(
            torch_worker.train_epoch,
            epoch,
            num_steps,
            info,
            self._keeps_state,
            progress=f"epoch {epoch}",
        )
        state = results[0].pop("_state", None)
        self.epoch = epoch + 1
        stats = reduce_worker_stats(results)
        stats["epoch"] = epoch
        return self._end_epoch(stats, state)

    def validate(
        self, num_steps: int | None = None, info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Evaluate on the validation loader; returns ``val_loss`` (and ``val_accuracy``)."""
        results = self._run(torch_worker.validate, num_steps, info)
        return reduce_worker_stats(results)

    def apply_all_operators(self, fn: Callable[[TrainingOperator], Any]) -> list[Any]:
        """Run ``fn(operator)`` on every worker's :class:`TrainingOperator`; results in rank order."""
        return self._run(torch_worker.apply_to_operator, fn)

    def get_model(self) -> torch.nn.Module | tuple[torch.nn.Module, ...]:
        """The trained model(s) as plain modules on the driver's CPU."""
        state = self.state_dict()
        models = self.creators.create_models(self.config)
        for model, model_state in zip(models, state["models"], strict=True):
            model.load_state_dict(model_state)
            model.cpu()
        return models[0] if len(models) == 1 else models
