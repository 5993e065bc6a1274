"""The worker side of a backend: one strategy per framework, as in Lightning Fabric.

A strategy runs inside every worker. :class:`TorchStrategy` prepares torch
components (wrap models, shard optimizers), back-propagates, steps, skips
gradient sync and converts state to and from the consolidated, backend-neutral
form; its :class:`~polytrain.backends.core.precision.Precision` does mixed precision.
:class:`KerasStrategy` builds a ``tf.distribute`` strategy and prepares a Keras
model and its data sets for ``fit``. Each framework's strategy has only the
hooks that make sense for it.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.precision import Precision, default_precision

if TYPE_CHECKING:
    import torch

    from polytrain.backends.core.step_options import MicroBatch

logger = logging.getLogger(__name__)


class Strategy(abc.ABC):
    """What every framework's worker side does: prepare components, and move their state.

    Args:
        config: the backend's typed config.
    """

    framework: str = ""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    @abc.abstractmethod
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap what the creators built for this backend."""

    @abc.abstractmethod
    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker: consolidated, backend-independent ``{"models": [...], "optimizers": [...]}``.

        Called on every rank at once (sharded strategies gather here); only rank 0's
        return value is used, other ranks may return ``None``.
        """

    @abc.abstractmethod
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load a consolidated state (as :meth:`full_state_dict` returns) on every rank."""

    def worker_scope(self, ctx: WorkerContext) -> contextlib.AbstractContextManager:
        """Worker: a context around every call into the worker."""
        return contextlib.nullcontext()


class TorchStrategy(Strategy):
    """Plain torch: no wrapping, local optimizer steps (also the base of every torch backend).

    On its own it is the no-op strategy: workers that train independently, used
    to test the executor without any communication library.
    """

    framework = "torch"

    # ------------------------------------------------------------ preparation
    def make_precision(self, ctx: WorkerContext) -> Precision:
        """Worker: the precision plugin for this worker (fp16/bf16 with ``use_fp16``)."""
        return default_precision(ctx)

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: move nothing and wrap nothing (subclasses wrap models and optimizers)."""
        return components

    def build_models(
        self, create: Callable[[], Sequence[Any]], ctx: WorkerContext
    ) -> Sequence[Any]:
        """Worker: call ``create`` (the user's ``model_creator``) and put the models on this worker's device.

        The sharded backends override it to build the full model on rank 0 only
        (:mod:`polytrain.backends.core.meta_init`). Moved in place: the optimizer
        creator gets the very objects ``model_creator`` returned. Weights that
        ``polytrain.hf.from_pretrained`` left in the files are read here, whole, by every
        rank (:mod:`polytrain.backends.core.pretrained_fill`).
        """
        from polytrain.backends.core import pretrained_fill

        with pretrained_fill.building("empty"):
            models = create()
        for model in models:
            model.to(ctx.device)
            pretrained_fill.fill_whole(model)
        return models

    def setup(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: give ``components`` this worker's precision, then :meth:`prepare` them.

        The one preparation sequence of the trainers and the Lightning strategies.
        """
        components.precision = self.make_precision(ctx)
        with self.worker_scope(ctx):
            return self.prepare(components, ctx)

    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: ``(num_replicas, rank)`` for the distributed samplers of the loaders."""
        return ctx.world_size, ctx.world_rank

    @contextlib.contextmanager
    def worker_scope(self, ctx: WorkerContext) -> Iterator[None]:
        """Worker: the worker's CUDA device as the current device (nothing on CPU)."""
        if ctx.device.type == "cuda":
            import torch

            with torch.cuda.device(ctx.device):
                yield
        else:
            yield

    # ------------------------------------------------------------------- step
    def autocast(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: the mixed-precision context of a forward pass."""
        precision = components.precision
        return precision.autocast() if precision is not None else contextlib.nullcontext()

    def zero_grad(self, components: Components) -> None:
        """Worker: clear the gradients of every optimizer."""
        for optimizer in components.optimizers:
            optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: back-propagate ``loss`` through the precision plugin."""
        (components.precision or Precision()).backward(loss)

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: apply the gradients (every optimizer, or only ``optimizer_index``)."""
        (components.precision or Precision()).step(stepped(components, optimizer_index))

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: a context in which backward passes do not synchronise gradients."""
        return contextlib.nullcontext()

    def accumulation_loss(
        self, loss: torch.Tensor, components: Components, micro: MicroBatch
    ) -> torch.Tensor:
        """Worker: the loss to back-propagate for one of ``micro.size`` micro-batches.

        Divided by ``micro.size``, so the accumulated gradients are those of one step
        over the whole (k-times larger) batch.
        """
        return loss / micro.size if micro.size > 1 else loss

    def end_micro_batch(self, components: Components, micro: MicroBatch) -> None:
        """Worker: after the backward of a micro-batch that is not the step's last (nothing here)."""

    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: clip the global gradient norm to ``max_norm``; return the norm before clipping.

        Called after the backward of the step's last micro-batch, before :meth:`step`.
        Gradients are unscaled first (fp16). Here: ``torch.nn.utils.clip_grad_norm_``
        over every model's parameters (or, with ``optimizer_index``, over that
        optimizer's: the gradients its :meth:`step` applies), right where gradients
        are whole on every rank after backward (plain torch, DDP) or DTensors (FSDP2).
        ``None``: the backend clips inside its step (read the norm with
        :meth:`step_grad_norm`).
        """
        import torch

        (components.precision or Precision()).unscale_(stepped(components, optimizer_index))
        return _full(
            torch.nn.utils.clip_grad_norm_(clipped_params(components, optimizer_index), max_norm)
        )

    def step_grad_norm(self, components: Components) -> float | None:
        """Worker: the norm a backend that clips inside :meth:`step` measured (None here)."""
        return None

    # ------------------------------------------------------------------ state
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Worker: the user's module inside whatever wrapper :meth:`prepare` added."""
        return getattr(model, "module", model)

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker: rank 0's models (unwrapped) and optimizers in torch format."""
        if ctx.world_rank != 0:
            return None
        return {
            "models": [self.unwrap_model(m).state_dict() for m in components.models],
            "optimizers": [o.state_dict() for o in components.optimizers],
        }

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load models and torch-format optimizer states on every rank."""
        for model, model_state in zip(components.models, state["models"], strict=True):
            self.unwrap_model(model).load_state_dict(model_state)
        load_optimizer_states(components.optimizers, state.get("optimizers"))


def stepped(components: Components, optimizer_index: int | None) -> list[Any]:
    """The optimizers a step of ``optimizer_index`` applies: all of them for None."""
    optimizers = components.optimizers
    return list(optimizers) if optimizer_index is None else [optimizers[optimizer_index]]


def clipped_params(components: Components, optimizer_index: int | None) -> list[Any]:
    """The parameters whose gradients one clip measures: every model's, or one optimizer's."""
    if optimizer_index is None:
        return [p for model in components.models for p in model.parameters()]
    optimizer = components.optimizers[optimizer_index]
    return [p for group in optimizer.param_groups for p in group["params"]]


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a norm that may be a DTensor (FSDP2's gradients)."""
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


class KerasStrategy(Strategy):
    """The worker side of a Keras backend: a ``tf.distribute`` strategy and ``fit``-ready data."""

    framework = "tensorflow"

    @abc.abstractmethod
    def distribution_strategy(self, ctx: WorkerContext) -> Any:
        """Worker: the ``tf.distribute.Strategy`` the model is built under."""


def load_optimizer_states(optimizers: list[Any], states: list[Any] | None) -> None:
    """Load torch-format optimizer states; a checkpoint without them keeps fresh optimizers.

    Strategies whose optimizer state has no portable form (they say so when saving)
    write ``None`` entries: the weights still load, and training resumes with a
    freshly initialised optimizer state.
    """
    if not states:
        logger.warning("The checkpoint has no optimizer state; optimizers start fresh.")
        return
    for optimizer, state in zip(optimizers, states, strict=True):
        if state is None:
            logger.warning(
                "No portable state for optimizer %s; it starts fresh.", type(optimizer).__name__
            )
            continue
        optimizer.load_state_dict(state)
