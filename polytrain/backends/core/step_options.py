"""The training step's options that every torch backend carries out its own way.

:class:`StepOptions` is what the trainer's ``max_grad_norm=``,
``gradient_accumulation_steps=`` and ``precision=`` keywords become. It is
checked when the trainer is built (bad values fail there, naming what is
allowed) and travels to the workers inside the
:class:`~polytrain.backends.core.context.WorkerContext`, where each backend's
strategy reads it: DeepSpeed writes it into its engine config, the others clip,
skip gradient sync and autocast through their own APIs. No framework is
imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

#: The ``precision=`` values: full precision, bf16 autocast, fp16 autocast with loss scaling.
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class StepOptions:
    """How the default training step clips, accumulates and casts.

    Attributes:
        max_grad_norm: clip the global gradient norm (over every worker and shard) to
            this value before each optimizer step and report ``grad_norm`` (the norm
            before clipping); None: no clipping.
        gradient_accumulation_steps: micro-batches per optimizer step. Gradients are
            synchronised only on the last one where the backend can skip it, the loss
            is divided so the step equals one over the k-times larger batch, and
            ``num_steps``, ``global_step`` and "batch" schedulers count optimizer steps.
        precision: "fp32", "bf16" (bf16 autocast, no loss scaling; CPU and GPU) or
            "fp16" (fp16 autocast with a gradient scaler on GPU; on CPU, where fp16
            kernels are slow or missing, it runs as bf16, as ``use_fp16`` always did).
        activation_checkpointing: False (off), True (HF models' own gradient
            checkpointing, else the repeated blocks) or a tuple of module classes / class
            names whose activations are recomputed in backward (non-reentrant), applied
            on the worker before the backend wraps the model
            (:func:`~polytrain.backends.core.blocks.apply_activation_checkpointing`).
        compile: ``torch.compile`` the model on the worker, after the backend wrapped it
            (in place, so parameter names and state dicts are unchanged); backends that
            cannot refuse it when the trainer is built.

    Raises:
        ConfigError: a value that is not allowed, naming it and what to do.
    """

    max_grad_norm: float | None = None
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"
    activation_checkpointing: bool | tuple[Any, ...] = False
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "activation_checkpointing", _checked_checkpointing(self.activation_checkpointing)
        )
        if not isinstance(self.compile, bool):
            raise ConfigTypeError(
                f"compile must be True or False; got {type(self.compile).__name__}: "
                f"{self.compile!r}. Pass compile=True to torch.compile the model."
            )
        _check_max_grad_norm(self.max_grad_norm)
        _check_accumulation(self.gradient_accumulation_steps)
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision={self.precision!r} is not supported. Must be one of "
                f"{', '.join(repr(p) for p in PRECISIONS)} ('bf16' for bf16 autocast on CPU or "
                f"GPU, 'fp16' for fp16 with loss scaling on GPU). Pass one of them to the trainer."
            )

    @property
    def mixed(self) -> bool:
        """Whether a reduced-precision forward is on (``use_fp16`` in the worker context)."""
        return self.precision != "fp32"

    @property
    def accumulates(self) -> bool:
        """Whether an optimizer step spans several micro-batches."""
        return self.gradient_accumulation_steps > 1


def _check_max_grad_norm(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(
            f"max_grad_norm must be a positive number or None (no clipping); got "
            f"{type(value).__name__}: {value!r}. Pass e.g. max_grad_norm=1.0."
        )
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"max_grad_norm={value!r} is not allowed: it must be a positive, finite number "
            f"(the largest global gradient norm), or None to turn clipping off. Pass e.g. "
            f"max_grad_norm=1.0."
        )


def _checked_checkpointing(value: Any) -> bool | tuple[Any, ...]:
    """``value`` as False, True or a tuple of classes / class names (names are looked up on the workers)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (str, type)):
        value = [value]
    items = tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else None
    if not items or any(not isinstance(i, (str, type)) or i == "" for i in items):
        raise ConfigTypeError(
            f"activation_checkpointing must be True, False or a non-empty list of module classes "
            f"or class names (e.g. ['GPT2Block']); got {type(value).__name__}: {value!r}. Pass "
            f"True to recompute the model's repeated blocks (or use HF gradient checkpointing)."
        )
    return items


def _check_accumulation(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"gradient_accumulation_steps={value!r} is not allowed: it must be an int >= 1 "
            f"(micro-batches per optimizer step; 1 means no accumulation). Pass e.g. "
            f"gradient_accumulation_steps=4."
        )


def step_options(
    max_grad_norm: float | None = None,
    gradient_accumulation_steps: int = 1,
    precision: str | None = None,
    use_fp16: bool = False,
    activation_checkpointing: Any = False,
    compile: bool = False,
) -> StepOptions:
    """The trainer keywords as :class:`StepOptions`; ``use_fp16=True`` is ``precision="fp16"``.

    Raises:
        ConfigError: a bad value, or ``use_fp16=True`` with another ``precision``.
    """
    if use_fp16 and precision not in (None, "fp16"):
        raise ConfigError(
            f"use_fp16=True means precision='fp16', but precision={precision!r} was given too. "
            f"Drop use_fp16 (it is an alias) and pass precision alone."
        )
    return StepOptions(
        max_grad_norm=max_grad_norm,
        gradient_accumulation_steps=gradient_accumulation_steps,
        precision=precision or ("fp16" if use_fp16 else "fp32"),
        activation_checkpointing=activation_checkpointing,
        compile=compile,
    )


@dataclass(frozen=True)
class MicroBatch:
    """Where a batch stands in its optimizer step.

    Attributes:
        index: the batch's position among the micro-batches of its step (from 0).
        size: the micro-batches of this step: ``gradient_accumulation_steps``, or fewer
            for the remainder at the end of an epoch.
    """

    index: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        """Whether gradients start afresh with this batch."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Whether the optimizer steps after this batch (gradients are synchronised in it)."""
        return self.index == self.size - 1
