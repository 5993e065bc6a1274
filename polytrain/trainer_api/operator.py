"""The worker-side training loop, and the class users subclass to customise it.

A :class:`TrainingOperator` runs inside every worker. The default
:meth:`~TrainingOperator.train_batch` is forward / loss / backward / step on a
``(features, target)`` batch; override it (and :meth:`validate_batch`) for GANs,
multiple losses or any other step. Whatever differs between backends (how to
back-propagate, step, skip gradient sync, autocast) is reached through the
operator's methods, which ask the backend's worker-side strategy: a custom
operator written once runs on every backend.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from polytrain.backends.base import Backend
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.strategy import TorchStrategy
from polytrain.errors import PolytrainError
from polytrain.launchers.worker import report_progress
from polytrain.trainer_api.data import move_to_device
from polytrain.trainer_api.results import is_finite_number


class NonFiniteLossError(PolytrainError, FloatingPointError):
    """The loss became NaN or infinite (fail-fast; disable with ``check_finite_loss=False``)."""


class TrainingOperator:
    """The per-worker training logic.

    Attributes available in every hook: ``model``/``models``, ``optimizer``/
    ``optimizers``, ``criterion``, ``scheduler``/``schedulers``, ``train_loader``,
    ``val_loader``, ``config`` (this worker's config: ``batch_size`` is the
    per-worker batch), ``device``, ``world_rank``, ``world_size``, ``use_fp16``,
    ``backend`` (the :class:`~polytrain.backends.base.Backend`: name and options) and
    ``strategy`` (its worker side, which the helpers below call).
    """

    def __init__(
        self,
        config: dict[str, Any],
        components: Components,
        backend: Backend,
        context: WorkerContext,
        scheduler_step_freq: str = "batch",
        check_finite_loss: bool = True,
        strategy: TorchStrategy | None = None,
    ) -> None:
        self.config = config
        self.components = components
        self.backend = backend
        self.strategy: TorchStrategy = strategy or backend.make_strategy()
        self.context = context
        self.scheduler_step_freq = scheduler_step_freq
        self.check_finite_loss = check_finite_loss
        self.global_step = 0
        self.last_val_loss: float | None = None

    # ----------------------------------------------------------- user hooks
    def setup(self, config: dict[str, Any]) -> None:
        """Called once on every worker after the components are built and prepared."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """One optimisation step on one batch; returns metrics including ``num_samples``.

        The default expects ``(features, target)`` or ``(*features, target)``.
        """
        *features, target = batch
        with self.autocast():
            output = self.model(*features)
            loss = self.criterion(output, target)
        self.zero_grad()
        self.backward(loss)
        self.step()
        return {"loss": loss.item(), "num_samples": _batch_len(target)}

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Evaluate one batch; returns ``val_loss``, ``num_samples`` and, for class logits, ``val_accuracy``."""
        *features, target = batch
        with self.autocast():
            output = self.model(*features)
            loss = self.criterion(output, target)
        stats = {"val_loss": loss.item(), "num_samples": _batch_len(target)}
        if (
            isinstance(output, torch.Tensor)
            and output.dim() == 2
            and isinstance(target, torch.Tensor)
            and target.dim() == 1
            and not target.is_floating_point()
        ):
            stats["val_accuracy"] = (output.argmax(dim=1) == target).float().mean().item()
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Extra state of a custom operator to keep in checkpoints (tensors and plain types)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ------------------------------------------------- backend-aware helpers
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for the forward pass (a no-op unless ``use_fp16``)."""
        return self.strategy.autocast(self.components)

    def zero_grad(self) -> None:
        """Clear gradients the way the backend needs it."""
        self.strategy.zero_grad(self.components)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate through the backend (scaling, engines, allreduce hooks)."""
        self.strategy.backward(loss, self.components)

    def step(self, optimizer_index: int | None = None) -> None:
        """Apply gradients through the backend; steps per-batch schedulers if configured."""
        self.strategy.step(self.components, optimizer_index)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for gradient accumulation: backward passes inside it do not synchronise."""
        return self.strategy.no_sync(self.components)

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in ``batch`` to this worker's device."""
        return move_to_device(batch, self.device)

    # ------------------------------------------------------------ the loops
    def train_epoch(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """Run :meth:`train_batch` over ``iterator``; returns this worker's epoch metrics."""
        self._set_train_mode(True)
        num_steps = info.get("num_steps")
        total = _safe_len(iterator)
        if num_steps is not None:
            total = num_steps if total is None else min(total, num_steps)
        sums: dict[str, float] = {}
        other: dict[str, Any] = {}
        samples = 0
        steps = 0
        start = time.perf_counter()
        report_progress(0, total, phase="train", epoch=info.get("epoch"))
        for batch_idx, batch in enumerate(iterator):
            if num_steps is not None and batch_idx >= num_steps:
                break
            batch_info = {
                **info,
                "batch_idx": batch_idx,
                "epoch_idx": info.get("epoch"),  # RaySGD's name
                "global_step": self.global_step,
            }
            metrics = self.train_batch(self.to_device(batch), batch_info)
            n = int(metrics.get("num_samples", 1)) if metrics else 1
            if self.check_finite_loss and metrics and "loss" in metrics:
                if not is_finite_number(float(metrics["loss"])):
                    raise NonFiniteLossError(
                        f"Loss became {metrics['loss']} at epoch {info.get('epoch')}, step "
                        f"{batch_idx} (global step {self.global_step}) on rank "
                        f"{self.world_rank}. Lower the learning rate, check the data for NaN/inf, "
                        f"or pass check_finite_loss=False to the trainer to continue anyway."
                    )
            _accumulate(metrics or {}, n, sums, other)
            samples += n
            steps += 1
            self.global_step += 1
            if self.scheduler_step_freq == "batch":
                self._step_schedulers()
            report_progress(
                steps,
                total,
                phase="train",
                epoch=info.get("epoch"),
                loss=metrics.get("loss") if metrics else None,
            )
        if steps == 0:
            raise ValueError(
                f"The training data loader of rank {self.world_rank} yielded no batches "
                f"(per-worker batch_size={self.config.get('batch_size')}, "
                f"len(loader)={_safe_len(iterator)}). Give the data_creator more data, lower "
                f"batch_size, or set drop_last=False."
            )
        if self.scheduler_step_freq == "epoch":
            self._step_schedulers()
        elapsed = time.perf_counter() - start
        result = {key: value / max(samples, 1) for key, value in sums.items()}
        result.update(other)
        result.update({"num_samples": samples, "num_steps": steps, "epoch_time_s": elapsed})
        report_progress(steps, total, phase="idle", epoch=info.get("epoch"))
        return result

    def validate(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """Run :meth:`validate_batch` over ``iterator`` without gradients; returns metrics."""
        self._set_train_mode(False)
        num_steps = info.get("num_steps")
        sums: dict[str, float] = {}
        other: dict[str, Any] = {}
        samples = 0
        start = time.perf_counter()
        with torch.no_grad():
            for batch_idx, batch in enumerate(iterator):
                if num_steps is not None and batch_idx >= num_steps:
                    break
                metrics = self.validate_batch(
                    self.to_device(batch), {**info, "batch_idx": batch_idx}
                )
                n = int(metrics.get("num_samples", 1)) if metrics else 1
                _accumulate(metrics or {}, n, sums, other)
                samples += n
                report_progress(batch_idx + 1, None, phase="validate")
        result = {key: value / max(samples, 1) for key, value in sums.items()}
        result.update(other)
        result.update({"num_samples": samples, "time_s": time.perf_counter() - start})
        report_progress(0, None, phase="idle")
        if "val_loss" in result:
            self.last_val_loss = result["val_loss"]
        return result

    def _set_train_mode(self, training: bool) -> None:
        for model in self.models:
            model.train(training)

    def _step_schedulers(self) -> None:
        for scheduler in self.schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                if self.last_val_loss is not None:
                    scheduler.step(self.last_val_loss)
            else:
                scheduler.step()

    # ------------------------------------------------------------ accessors
    @property
    def model(self) -> torch.nn.Module:
        """The first (prepared) model."""
        return self.components.models[0]

    @property
    def models(self) -> list[torch.nn.Module]:
        """All prepared models."""
        return self.components.models

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first optimizer."""
        return self.components.optimizers[0]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """All optimizers."""
        return self.components.optimizers

    @property
    def criterion(self) -> Any:
        """The loss function built by ``loss_creator``."""
        return self.components.criterion

    @property
    def scheduler(self) -> Any:
        """The first scheduler, or None."""
        return self.components.schedulers[0] if self.components.schedulers else None

    @property
    def schedulers(self) -> list[Any]:
        """All schedulers."""
        return self.components.schedulers

    @property
    def train_loader(self) -> Any:
        """This worker's training loader (with its distributed sampler)."""
        return self.components.train_loader

    @property
    def val_loader(self) -> Any:
        """This worker's validation loader, or None."""
        return self.components.val_loader

    @property
    def device(self) -> torch.device:
        """This worker's device."""
        return self.context.device

    @property
    def world_rank(self) -> int:
        """This worker's rank in the group."""
        return self.context.world_rank

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.context.world_size

    @property
    def use_fp16(self) -> bool:
        """Whether mixed precision is on."""
        return self.context.use_fp16


def _batch_len(target: Any) -> int:
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return int(target.shape[0])
    try:
        return len(target)
    except TypeError:
        return 1


def _safe_len(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


def _accumulate(
    metrics: dict[str, Any], n: int, sums: dict[str, float], other: dict[str, Any]
) -> None:
    for key, value in metrics.items():
        if key == "num_samples":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            sums[key] = sums.get(key, 0.0) + float(value) * n
        else:
            other[key] = value
