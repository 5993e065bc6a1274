"""Mixed precision as its own small object (worker side), as in Lightning Fabric.

A torch strategy owns one :class:`Precision`: the context a forward pass runs
in, and how a loss is back-propagated and an optimizer stepped when gradients
are scaled. Strategies whose wrapper casts by itself (FSDP2's
MixedPrecisionPolicy, FSDP1's MixedPrecision, DeepSpeed's engine) pick a
precision that leaves the forward alone.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from polytrain.backends.core.context import WorkerContext


class Precision:
    """Full precision: plain forward, ``loss.backward()``, ``optimizer.step()``.

    Attributes:
        scaler: the gradient scaler (``None``: gradients are not scaled).
    """

    scaler: Any = None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Worker: the context of a forward pass."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Worker: back-propagate ``loss`` (scaled when a scaler is in use)."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizers: list[Any]) -> None:
        """Worker: step ``optimizers`` (through the scaler, which then updates its scale)."""
        for optimizer in optimizers:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update()

    def unscale_(self, optimizers: list[Any]) -> None:
        """Worker: divide the gradients by the loss scale, before they are measured or clipped."""
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any] | None:
        """Worker: the scaler's state for checkpoints (``None`` without a scaler)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Worker: restore :meth:`state_dict`; a checkpoint without scaler state changes nothing."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class MixedPrecision(Precision):
    """Reduced-precision autocast: fp16 with a gradient scaler, or bf16 without one.

    ``dtype`` defaults to what ``use_fp16`` always meant: fp16 on GPU, bf16 on CPU
    (fp16 kernels are slow or missing on CPU, and bf16 needs no loss scaling).

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        cast_forward: False where the wrapper casts parameters and inputs itself
            (FSDP2's MixedPrecisionPolicy, FSDP1's MixedPrecision), so the forward runs without autocast.
        scaler: a scaler instance to use instead of ``torch.amp.GradScaler`` on GPU
            (sharded scalers check for infs across shards); fp16 only.
        dtype: the autocast dtype (None: fp16 on GPU, bf16 on CPU).
    """

    def __init__(
        self, device_type: str, cast_forward: bool = True, scaler: Any = None, dtype: Any = None
    ) -> None:
        import torch

        self.device_type = device_type
        self.cast_forward = cast_forward
        if dtype is None:
            dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
        self.dtype = dtype
        if dtype != torch.float16:
            scaler = None  # bf16 has fp32's range: nothing to scale
        elif scaler is None and device_type == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        self.scaler = scaler

    def autocast(self) -> contextlib.AbstractContextManager:
        """Worker: autocast to ``dtype`` (none when the wrapper casts itself)."""
        if not self.cast_forward:
            return contextlib.nullcontext()
        import torch

        return torch.autocast("cuda" if self.device_type == "cuda" else "cpu", dtype=self.dtype)


def amp_dtype(ctx: WorkerContext) -> torch.dtype | None:
    """The reduced dtype of ``ctx`` (None: full precision).

    ``precision="bf16"``: bf16 everywhere; ``"fp16"`` (and the ``use_fp16`` alias):
    fp16 on GPU, bf16 on CPU, where fp16 kernels are slow or missing.
    """
    if not ctx.use_fp16:
        return None
    import torch

    if ctx.step.precision == "bf16" or ctx.device.type != "cuda":
        return torch.bfloat16
    return torch.float16


def default_precision(
    ctx: WorkerContext, cast_forward: bool = True, scaler: Any = None
) -> Precision:
    """The precision for ``ctx``: :class:`MixedPrecision` with ``use_fp16``, else full precision.

    ``scaler`` is used for fp16 only (bf16 gradients are not scaled).
    """
    if not ctx.use_fp16:
        return Precision()
    return MixedPrecision(
        ctx.device.type, cast_forward=cast_forward, scaler=scaler, dtype=amp_dtype(ctx)
    )
