"""What a training step did through the operator's helpers, so a custom step keeps the step options.

The trainer's ``max_grad_norm``, ``gradient_accumulation_steps`` and ``precision``
(loss scaling) are carried out by :class:`~polytrain.trainer_api.torch.operator.TrainingOperator`'s
``zero_grad`` / ``backward`` / ``step``, which the default step and a RaySGD-style
custom step (``self.zero_grad(); self.backward(loss); self.step()``) both call. A
custom step that goes around them (``loss.backward()``, ``optimizer.step()``)
would train without those options and without a word: :class:`StepRecord` keeps
count of what went through the helpers and refuses such a step, naming the
option and the fix. Worker side; imports no framework.
"""

from __future__ import annotations

from typing import Any

from polytrain.backends.core.step_options import MicroBatch, StepOptions
from polytrain.errors import ConfigError


class StepOptionError(ConfigError):
    """A custom ``train_batch`` / ``train_epoch`` went around a step option it was given.

    A ``ValueError`` (through :class:`~polytrain.errors.ConfigError`): the trainer's
    options and the operator's step cannot run together as written.
    """


class StepRecord:
    """The helpers' calls in the current optimizer step and ``train()`` call of one worker.

    Args:
        options: the trainer's step options.
        num_optimizers: how many optimizers the creators built.
        scales_loss: whether a gradient scaler is in use (fp16 on GPU).
    """

    def __init__(self, options: StepOptions, num_optimizers: int, scales_loss: bool) -> None:
        self.options = options
        self.num_optimizers = num_optimizers
        self.scales_loss = scales_loss
        #: Where the loop's current batch stands in its optimizer step; None outside the loop.
        self.micro: MicroBatch | None = None
        self._clipped: set[int] = set()  # optimizers clipped since their last step
        self._backward_since_step = False
        self._batch_norms: dict[str, float] = {}
        self._call_norms: dict[str, list[float]] = {}
        self._call_steps = 0
        self._call_clips = 0

    # ------------------------------------------------------------ the loop
    def begin_call(self) -> None:
        """A ``train()`` call starts on this worker."""
        self._call_norms, self._call_steps, self._call_clips = {}, 0, 0
        self.micro = None

    def begin_batch(self, micro: MicroBatch) -> None:
        """The loop hands the next batch to ``train_batch``."""
        self.micro = micro
        self._batch_norms = {}

    def end_batch(self, metrics: dict[str, Any]) -> None:
        """``train_batch`` returned: add the grad norms of its step to ``metrics`` (its own win)."""
        self.micro = None
        for key, norm in self._batch_norms.items():
            metrics.setdefault(key, norm)

    def end_call(self, stats: dict[str, Any], own_loop: bool) -> None:
        """The call's ``train_epoch`` returned ``stats``: refuse options its step went around.

        ``own_loop``: the operator overrides ``train_epoch``, so the loop never added
        the grad norms per batch; the call's mean goes into ``stats`` (its own win).

        Raises:
            StepOptionError: the call trained without calling :meth:`TrainingOperator.step`
                although an option lives there (or, for ``max_grad_norm``, in
                ``clip_grad_norm_``).
        """
        self.micro = None
        if own_loop:
            for key, norms in self._call_norms.items():
                stats.setdefault(key, sum(norms) / len(norms))
        needed = self._options_in_step()
        if not needed or self._call_steps:
            return
        if needed == ["max_grad_norm"] and self._call_clips:
            return
        raise StepOptionError(
            f"The trainer was given {_listed(needed, self.options)}, which the operator's "
            f"self.step() applies, but this TrainingOperator's "
            f"{'train_epoch' if own_loop else 'train_batch'} stepped without calling it (e.g. "
            f"optimizer.step() directly), so the option would be ignored. Call "
            f"self.zero_grad(), self.backward(loss) and self.step() in your step (they clip, "
            f"accumulate and scale as the default step does), or drop "
            f"{' and '.join(needed)} from the trainer."
        )

    # ---------------------------------------------------------- the helpers
    def current(self) -> MicroBatch:
        """Where the current batch stands (outside the loop: a step of its own)."""
        return self.micro if self.micro is not None else MicroBatch()

    def backward(self) -> None:
        """``self.backward`` ran."""
        self._backward_since_step = True

    def step_position(self) -> MicroBatch:
        """Where a ``self.step()`` call stands; refuses one that cannot keep the options.

        Raises:
            StepOptionError: ``gradient_accumulation_steps > 1`` and the call comes from
                outside the trainer's batch loop (an operator's own ``train_epoch``), or a
                step that scales or accumulates whose backward went around ``self.backward``.
        """
        k = self.options.gradient_accumulation_steps
        if self.micro is None and k > 1:
            raise StepOptionError(
                f"gradient_accumulation_steps={k} groups the batches of the trainer's loop "
                f"(TrainingOperator.train_epoch) into optimizer steps, but self.step() was called "
                f"outside it (this operator's own train_epoch), where no batch has a place in a "
                f"step. Override train_batch instead of train_epoch (self.zero_grad(), "
                f"self.backward() and self.step() then accumulate), or accumulate in your "
                f"train_epoch and drop gradient_accumulation_steps from the trainer."
            )
        micro = self.current()
        if micro.last and not self._backward_since_step and (self.scales_loss or k > 1):
            option = (
                f"gradient_accumulation_steps={k} (the loss divided by the step's batches, "
                f"gradient sync skipped on all but the last)"
                if k > 1
                else f"precision={self.options.precision!r} (the loss scaled for fp16)"
            )
            raise StepOptionError(
                f"self.step() was called, but no self.backward(loss) since the last step: the "
                f"loss was back-propagated directly (loss.backward()), which leaves out {option}. "
                f"Call self.backward(loss) instead of loss.backward()."
            )
        return micro

    def needs_clip(self, optimizer_index: int | None) -> bool:
        """Whether ``self.step(optimizer_index)`` clips: ``max_grad_norm`` set, not clipped yet."""
        if self.options.max_grad_norm is None:
            return False
        return not set(self._indices(optimizer_index)) <= self._clipped

    def clipped(self, optimizer_index: int | None, norm: Any) -> None:
        """A clip of ``optimizer_index``'s gradients (None: all) measured ``norm``."""
        self._clipped.update(self._indices(optimizer_index))
        self._call_clips += 1
        self._note_norm(optimizer_index, norm)

    def stepped(self, optimizer_index: int | None, norm: Any = None) -> None:
        """``self.step(optimizer_index)`` applied the gradients (``norm``: measured by the engine)."""
        self._clipped.difference_update(self._indices(optimizer_index))
        self._backward_since_step = False
        self._call_steps += 1
        if norm is not None:
            self._note_norm(optimizer_index, norm)

    def _note_norm(self, optimizer_index: int | None, norm: Any) -> None:
        if norm is None or self.options.max_grad_norm is None:
            return  # reported as the default step does: with max_grad_norm
        key = "grad_norm"
        if optimizer_index is not None and self.num_optimizers > 1:
            key = f"grad_norm_{optimizer_index}"
        self._batch_norms[key] = float(norm)
        self._call_norms.setdefault(key, []).append(float(norm))

    def _indices(self, optimizer_index: int | None) -> range | list[int]:
        return range(self.num_optimizers) if optimizer_index is None else [optimizer_index]

    def _options_in_step(self) -> list[str]:
        """The given options that only the helpers carry out."""
        options = self.options
        needed = []
        if options.max_grad_norm is not None:
            needed.append("max_grad_norm")
        if options.accumulates:
            needed.append("gradient_accumulation_steps")
        if self.scales_loss:
            needed.append("precision")
        return needed


def _listed(names: list[str], options: StepOptions) -> str:
    return ", ".join(f"{name}={getattr(options, name)!r}" for name in names)
