"""The worker-side training loop, and the class users subclass to customise it.

A :class:`TrainingOperator` runs inside every worker. The default
:meth:`~TrainingOperator.train_batch` is forward / loss / backward / step on a
``(features, target)`` batch; override it (and :meth:`validate_batch`) for GANs,
multiple losses or any other step. Whatever differs between backends (how to
back-propagate, step, skip gradient sync, autocast) is reached through the
operator's methods, which ask the backend's worker-side strategy: a custom
operator written once runs on every backend.

The trainer's step options hold for a custom step as for the default one, which
is itself ``self.zero_grad(); self.backward(loss); self.step()`` around a forward:
``self.step()`` clips to ``max_grad_norm`` (unless the step called
``self.clip_grad_norm_``), the three helpers accumulate over
``gradient_accumulation_steps`` batches, an overridden ``train_batch`` /
``train_epoch`` / ``validate_batch`` runs under the ``precision``'s autocast, and
``activation_checkpointing`` / ``compile`` are applied to the model before the
operator exists. A custom step that goes around the helpers where an option
lives there is refused (:mod:`polytrain.trainer_api.torch.step_record`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.errors import CreatorError, PolytrainError
from polytrain.launchers.worker import report_progress
from polytrain.trainer_api.data.loaders import move_to_device
from polytrain.trainer_api.profiling import PhaseTimer
from polytrain.trainer_api.results import is_finite_number
from polytrain.trainer_api.torch import default_step
from polytrain.trainer_api.torch.step_record import StepRecord


class NonFiniteLossError(PolytrainError, FloatingPointError):
    """The loss became NaN or infinite (fail-fast; disable with ``check_finite_loss=False``)."""


class TrainingOperator:
    """The per-worker training logic.

    Attributes available in every hook: ``model``/``models``, ``optimizer``/
    ``optimizers``, ``criterion``, ``scheduler``/``schedulers``, ``train_loader``,
    ``val_loader``, ``config`` (this worker's config: ``batch_size`` is the
    per-worker batch), ``device``, ``world_rank``, ``world_size``, ``use_fp16``,
    ``backend`` (the :class:`~polytrain.backends.core.backend.Backend`: name and options) and
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
        #: Times the phases of the current call when it was made with ``profile=True``.
        self.timer = PhaseTimer()
        self._record = StepRecord(
            context.step, len(components.optimizers), components.scaler is not None
        )

    # ----------------------------------------------------------- user hooks
    def setup(self, config: dict[str, Any]) -> None:
        """Called once on every worker after the components are built and prepared."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch, and the optimizer step after a step's last; returns metrics.

        The default takes ``(features, target)``, ``(*features, target)`` or a mapping
        batch (``model(**batch)``; the output's own loss without a ``loss_creator``),
        see :mod:`polytrain.trainer_api.torch.default_step`, and trains ``self.model`` with
        ``self.optimizer``: with several models or optimizers it raises
        :class:`~polytrain.errors.CreatorError` rather than train only the first.
        ``batch_info["micro_step"]`` and ``["num_micro_steps"]`` say where the batch
        stands in its optimizer step (``gradient_accumulation_steps``). Metrics: ``loss``,
        ``num_samples``, ``num_tokens`` for token batches, ``grad_norm`` with ``max_grad_norm``.
        """
        self.check_single_model()  # a custom train_epoch may call this step too
        return default_step.train_step(self, batch, batch_info)

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Evaluate one batch: ``val_loss``, ``num_samples``, ``val_accuracy`` for class logits.

        Token batches add ``num_tokens``, causal language models ``val_perplexity``.
        """
        return default_step.validate_step(self, batch)

    def check_single_model(self) -> None:
        """Raise :class:`~polytrain.errors.CreatorError` if there is more than one model or optimizer.

        For steps that train one model with one optimizer, such as the default
        :meth:`train_batch`: they would silently train only the first.
        """
        counts = {"model_creator": len(self.models), "optimizer_creator": len(self.optimizers)}
        for creator, count in counts.items():
            if count > 1:
                raise CreatorError(
                    f"{creator} returned {count} objects, and the default training step "
                    f"trains one model with one optimizer (it would silently train only the "
                    f"first). Write a TrainingOperator subclass whose train_batch (or "
                    f"train_epoch) uses self.models and self.optimizers, and pass it as "
                    f"training_operator_cls (docs/trainer.md: Custom steps). Several schedulers are "
                    f"fine: the default step steps all of them."
                )

    def state_dict(self) -> dict[str, Any]:
        """Extra state of a custom operator to keep in checkpoints (tensors and plain types)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ------------------------------------------------- backend-aware helpers
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for the forward pass (a no-op unless ``use_fp16``).

        An overridden ``train_batch``, ``train_epoch`` or ``validate_batch`` already runs
        inside it (as Lightning runs a ``training_step``); the default step's forward too.
        """
        return self.strategy.autocast(self.components)

    def zero_grad(self) -> None:
        """Clear gradients the way the backend needs it (``step_s`` of a profile).

        With ``gradient_accumulation_steps=k`` only the first batch of a step clears
        them; the other k-1 add theirs.
        """
        if not self._record.current().first:
            return
        with self.timer.phase("step"):
            self.strategy.zero_grad(self.components)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate through the backend (scaling, engines, allreduce hooks; ``backward_s``).

        With ``gradient_accumulation_steps=k`` the loss is divided by the step's batches
        (k, or fewer for an epoch's remainder), so the step equals one over the k-times
        larger batch, and every batch but the step's last skips the gradient sync.
        """
        micro = self._record.current()
        self._record.backward()
        with self.timer.phase("backward"):
            scaled = self.strategy.accumulation_loss(loss, self.components, micro)
            with contextlib.nullcontext() if micro.last else self.no_sync():
                self.strategy.backward(scaled, self.components)

    def step(self, optimizer_index: int | None = None) -> None:
        """Apply gradients through the backend (``step_s`` of a profile).

        With the trainer's ``max_grad_norm``, first clips the global gradient norm
        (every optimizer's, or ``optimizer_index``'s) as :meth:`clip_grad_norm_` does,
        unless this step called that already, and reports ``grad_norm`` (with several
        optimizers stepped one by one, ``grad_norm_<index>``). With
        ``gradient_accumulation_steps=k`` only the last batch of a step applies them.

        Raises:
            StepOptionError: (a ``ValueError``) accumulation outside the trainer's batch
                loop, or a step whose loss was not back-propagated with :meth:`backward`
                where that scales or accumulates; the message says what to call instead.
        """
        micro = self._record.step_position()
        with self.timer.phase("step"):
            if not micro.last:
                self.strategy.end_micro_batch(self.components, micro)
                return
            measured = None
            if self._record.needs_clip(optimizer_index):
                max_norm = self.context.step.max_grad_norm
                measured = self.strategy.clip_grad_norm_(self.components, max_norm, optimizer_index)
                self._record.clipped(optimizer_index, measured)
            self.strategy.step(self.components, optimizer_index)
            engine_norm = None
            if self.context.step.max_grad_norm is not None and measured is None:
                engine_norm = self.strategy.step_grad_norm(self.components)  # DeepSpeed's
        self._record.stepped(optimizer_index, engine_norm)

    def clip_grad_norm_(
        self, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Clip the global gradient norm where the backend needs it; the norm before clipping.

        Call it between :meth:`backward` and :meth:`step` (which then does not clip
        again); ``optimizer_index``: only the gradients that optimizer applies. ``None``
        where the backend clips inside its step (DeepSpeed, to the trainer's
        ``max_grad_norm``), and on the batches of a step that do not step
        (``gradient_accumulation_steps``).
        """
        if not self._record.current().last:
            return None
        with self.timer.phase("step"):
            norm = self.strategy.clip_grad_norm_(self.components, max_norm, optimizer_index)
        self._record.clipped(optimizer_index, norm)
        return norm

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for gradient accumulation: backward passes inside it do not synchronise."""
        return self.strategy.no_sync(self.components)

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in ``batch`` to this worker's device."""
        return move_to_device(batch, self.device)

    # ------------------------------------------------------------ the loops
    def train_epoch(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """Run :meth:`train_batch` over ``iterator``; returns this worker's metrics for the call.

        ``iterator`` yields this call's batches: the rest of the epoch, or at most
        ``info["num_steps"]`` optimizer steps (of ``gradient_accumulation_steps``
        batches each), continuing where the previous call stopped (it ends early at
        the end of the epoch, whose remainder of batches gets a step). ``info`` holds
        ``epoch_idx`` (also as ``epoch``), ``num_steps`` and whatever the driver passed
        to ``train(info=...)``;
        each batch's ``batch_info`` adds ``batch_idx`` (the batch's index in the
        epoch) and ``global_step``.
        """
        self._set_train_mode(True)
        num_steps = info.get("num_steps")
        epoch = info.get("epoch_idx", info.get("epoch"))
        k = self.context.step.gradient_accumulation_steps
        total = _expected_steps(iterator, num_steps, k)
        first_idx = int(info.get("first_batch_idx", 0))
        tally = _Tally()
        custom_batch = overrides(self, "train_batch")
        report_progress(0, total, phase="train", epoch=epoch)
        for batch, micro in default_step.micro_batches(iterator, k):
            if num_steps is not None and tally.steps >= num_steps:
                break
            batch_idx = first_idx + tally.batches
            with self.timer.phase("data"):
                batch = self.to_device(batch)
            batch_info = {
                **info,
                "batch_idx": batch_idx,
                "epoch_idx": epoch,
                "global_step": self.global_step,
                "micro_step": micro.index,
                "num_micro_steps": micro.size,
            }
            self._record.begin_batch(micro)
            with self.timer.phase("batch"), self._autocast_if(custom_batch):
                metrics = self.train_batch(batch, batch_info) or {}
            self._record.end_batch(metrics)
            self._check_loss(metrics, epoch, batch_idx)
            tally.add(metrics, step=micro.last)
            if not micro.last:
                continue
            self.global_step += 1
            if self.scheduler_step_freq == "batch":
                self._step_schedulers()
            report_progress(
                tally.steps, total, phase="train", epoch=epoch, loss=metrics.get("loss")
            )
        if tally.steps == 0:
            raise CreatorError(
                f"The training data loader of rank {self.world_rank} yielded no batches "
                f"(per-worker batch_size={self.config.get('batch_size')}, "
                f"len(loader)={_safe_len(self.train_loader)}). Give the data_creator more "
                f"data, lower batch_size, or set drop_last=False."
            )
        if self.scheduler_step_freq == "epoch" and _ends_epoch(iterator):
            self._step_schedulers()
        report_progress(tally.steps, total, phase="idle", epoch=epoch)
        return tally.result("epoch_time_s")

    def train_call(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """One ``train()`` call on this worker: :meth:`train_epoch`, keeping the step options.

        What the worker runs (override :meth:`train_epoch`, not this). An overridden
        ``train_epoch`` runs under the precision's autocast and gets the mean
        ``grad_norm`` of its steps; a call whose step went around :meth:`step` where
        an option lives there fails with :class:`StepOptionError`.
        """
        own_loop = overrides(self, "train_epoch")
        self._record.begin_call()
        with self._autocast_if(own_loop):
            stats = self.train_epoch(iterator, info)
        self._record.end_call(stats, own_loop)
        return stats

    def _autocast_if(self, custom: bool) -> contextlib.AbstractContextManager:
        # A user's step may not open the autocast itself; the default step does.
        return self.autocast() if custom else contextlib.nullcontext()

    def _check_loss(self, metrics: dict[str, Any], epoch: Any, batch_idx: int) -> None:
        if not (self.check_finite_loss and "loss" in metrics):
            return
        if not is_finite_number(float(metrics["loss"])):
            raise NonFiniteLossError(
                f"Loss became {metrics['loss']} at epoch {epoch}, step {batch_idx} (global "
                f"step {self.global_step}) on rank {self.world_rank}. Lower the learning rate, "
                f"check the data for NaN/inf, or pass check_finite_loss=False to the trainer "
                f"to continue anyway."
            )

    def validate(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """Run :meth:`validate_batch` over ``iterator`` without gradients; returns metrics.

        ``info["num_steps"]`` (None: all of it) caps the batches evaluated.
        """
        self._set_train_mode(False)
        num_steps = info.get("num_steps")
        tally = _Tally()
        custom_batch = overrides(self, "validate_batch")
        with torch.no_grad():
            batches = iter(iterator)
            while num_steps is None or tally.steps < num_steps:
                with self.timer.phase("data"):
                    batch = next(batches, _END)
                    if batch is _END:
                        break
                    batch = self.to_device(batch)
                with self.timer.phase("batch"), self._autocast_if(custom_batch):
                    metrics = self.validate_batch(batch, {**info, "batch_idx": tally.steps})
                tally.add(metrics or {})
                report_progress(tally.steps, None, phase="validate")
        result = tally.result("time_s")
        report_progress(0, None, phase="idle")
        if "val_loss" in result:
            self.last_val_loss = result["val_loss"]
        if "val_perplexity" in result:  # of the mean loss, not the mean of the batches'
            result["val_perplexity"] = default_step.perplexity(result["val_loss"])
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


_END = object()


def overrides(operator: TrainingOperator, name: str) -> bool:
    """Whether ``operator`` replaces :class:`TrainingOperator`'s method ``name``.

    On its class, or on the instance (RaySGD's tests assign ``train_batch`` in ``setup``).
    """
    method = getattr(operator, name)
    return getattr(method, "__func__", method) is not getattr(TrainingOperator, name)


def _expected_steps(iterator: Any, num_steps: int | None, k: int = 1) -> int | None:
    total = _safe_len(iterator)
    total = -(-total // k) if total is not None else None  # optimizer steps, remainder too
    if num_steps is not None:
        total = num_steps if total is None else min(total, num_steps)
    return total


def _ends_epoch(iterator: Any) -> bool:
    """Whether this call's batches reached the end of the epoch (a plain iterable: yes)."""
    ends_epoch = getattr(iterator, "ends_epoch", None)
    return ends_epoch() if callable(ends_epoch) else True


class _Tally:
    """Sample-weighted sums of a call's batch metrics (a metric over the batches reporting it)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.other: dict[str, Any] = {}
        self.samples = 0
        self.steps = 0  # optimizer steps
        self.batches = 0
        self.start = time.perf_counter()

    def add(self, metrics: dict[str, Any], step: bool = True) -> None:
        n = int(metrics.get("num_samples", 1)) if metrics else 1
        _accumulate(metrics, n, self.sums, self.other, self.weights)
        self.samples += n
        self.batches += 1
        self.steps += int(step)

    def result(self, time_key: str) -> dict[str, Any]:
        result = {key: value / max(self.weights[key], 1) for key, value in self.sums.items()}
        result.update(self.other)
        result.update(
            {
                "num_samples": self.samples,
                "num_steps": self.steps,
                time_key: time.perf_counter() - self.start,
            }
        )
        return result


#: Per-batch metrics that a call sums rather than averages.
_COUNTS = frozenset({"num_tokens"})


def _safe_len(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


def _accumulate(
    metrics: dict[str, Any],
    n: int,
    sums: dict[str, float],
    other: dict[str, Any],
    weights: dict[str, float],
) -> None:
    for key, value in metrics.items():
        if key == "num_samples":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # Counts add up; anything else is a mean weighted by the batches' samples.
            w = 1 if key in _COUNTS else n
            sums[key] = sums.get(key, 0.0) + float(value) * w
            weights[key] = weights.get(key, 0.0) + (0 if key in _COUNTS else n)
        else:
            other[key] = value
