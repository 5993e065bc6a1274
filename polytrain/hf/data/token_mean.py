"""The loss of a step as one process computes it: the mean over the global batch's trained tokens.

With prompts masked (or rows padded, or examples packed), workers hold different
numbers of trained tokens. The default step averages each worker's own mean and
the backends average the gradients over the workers, which weights a token of a
short batch more than one of a long batch: the result differs from one process
training the whole batch, and from one world size to another. (Micro-batches of
gradient accumulation have the same problem.)

:class:`TokenMeanOperator` counts the trained tokens of each optimizer step over
every worker and micro-batch first (one all-reduce of one number per step) and
gives the model ``num_items_in_batch``: transformers' losses then sum over the
tokens and divide by it, scaled so that the backends' averaging over workers and
micro-batches leaves the sum over every trained token of the step divided by
their count. Per-step losses and weights then equal a single process's on the
same global batch, at any world size and accumulation.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.hf.data.encoding import IGNORE_INDEX
from polytrain.trainer_api.torch.operator import TrainingOperator

__all__ = ["TokenMeanOperator", "step_token_count", "sum_over_workers"]


def step_token_count(batch: Mapping[str, Any]) -> int:
    """The predictions a causal LM's loss counts in ``batch``: shifted labels that are not -100.

    Raises:
        ConfigTypeError: a batch without integer ``labels``.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        raise ConfigTypeError(
            f"TokenMeanOperator trains mapping batches with integer 'labels' (as "
            f"polytrain.hf.data makes them); got {type(batch).__name__} with keys "
            f"{sorted(batch) if isinstance(batch, Mapping) else None}."
        )
    return int((labels[..., 1:] != IGNORE_INDEX).sum().item())


def sum_over_workers(values: list[float], device: torch.device) -> tuple[list[float], int]:
    """``(sums over every worker, number of workers)`` of ``values`` (one all-reduce).

    Uses the default process group (ddp, fsdp, fairscale, deepspeed) or Horovod
    (whose workers have no process group); a single process returns the values.
    """
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        tensor = tensor.to(device)
        dist.all_reduce(tensor)
        return tensor.cpu().tolist(), dist.get_world_size()
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        return hvd.allreduce(tensor, op=hvd.Sum).tolist(), hvd.size()
    return values, 1


#: Training needs no key/value cache, and with one transformers' models attend across
#: the examples of a packed row.
_NO_CACHE = {"use_cache": False}


class _StepTokens:
    """The training batches with ``num_items_in_batch`` set from their step's global token count.

    Groups batches by optimizer step as the default loop does (``k`` at a time, the
    last group of a call possibly shorter) and forwards ``len`` and ``ends_epoch``.
    """

    def __init__(self, batches: Iterable, k: int, device: torch.device) -> None:
        self.batches = batches
        self.k = k
        self.device = device
        self.tokens = 0.0  # the current step's trained tokens over every worker
        self.loss_sum = 0.0  # this worker's summed token losses of the current step

    def __len__(self) -> int:
        return len(self.batches)  # TypeError for unsized loaders, as the loop expects

    def __getattr__(self, name: str) -> Any:  # ends_epoch and the like, of the batches
        if "batches" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["batches"], name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(self.batches)
        while group := list(itertools.islice(batches, self.k)):
            local = sum(step_token_count(batch) for batch in group)
            (total,), workers = sum_over_workers([float(local)], self.device)
            self.tokens, self.loss_sum = total, 0.0
            # The backends average over workers and the step over its micro-batches: a
            # divisor of total / (workers * micro-batches) leaves sum / total.
            divisor = max(total, 1.0) / (workers * len(group))
            for batch in group:
                yield {**batch, **_NO_CACHE, "num_items_in_batch": divisor}


class TokenMeanOperator(TrainingOperator):
    """The default step, with every step's loss the mean over all its trained tokens.

    For causal LMs from ``transformers`` (and ``peft`` models of them) trained on
    mapping batches with ``labels``, such as :mod:`polytrain.hf.data` makes. The
    reported ``loss`` of a step is the global token mean (the same on every worker);
    ``num_tokens`` counts the trained labels. Every batch goes in with
    ``use_cache=False`` (packed rows need it). Validation is the default step
    (``val_loss``: the mean of the batches' token means).

    Example:
        >>> TorchTrainer(..., data_creator=creator, training_operator_cls=TokenMeanOperator)

    Raises:
        ConfigError: (at set-up) a ``loss_creator`` (the model's own loss is used), or
            a model whose ``forward`` takes no loss keyword arguments.
    """

    def setup(self, config: dict[str, Any]) -> None:
        """Check that the model computes its own loss and takes ``num_items_in_batch``."""
        if self.criterion is not None:
            raise ConfigError(
                f"TokenMeanOperator uses the model's own loss (transformers' causal LM loss, "
                f"divided by the step's token count); got a loss_creator "
                f"({type(self.criterion).__name__}). Drop loss_creator."
            )
        model = self.strategy.unwrap_model(self.model)
        if not accepts_loss_kwargs(model):
            raise ConfigError(
                f"TokenMeanOperator passes num_items_in_batch to the model, and "
                f"{type(model).__name__}.forward takes no such argument (a transformers "
                f"model's forward takes **kwargs). Use the default operator for this model."
            )

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """The default validation step, without the key/value cache."""
        if isinstance(batch, Mapping):
            batch = {**batch, **_NO_CACHE}
        return super().validate_batch(batch, batch_info)

    def train_epoch(self, iterator: Iterable, info: dict[str, Any]) -> dict[str, Any]:
        """The default loop over batches that carry their step's token divisor."""
        k = self.context.step.gradient_accumulation_steps
        self._step_tokens = _StepTokens(iterator, k, self.device)
        return super().train_epoch(self._step_tokens, info)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """The default step; ``loss`` is reported once per step: the step's global token mean."""
        metrics = super().train_batch(batch, batch_info)
        tokens = getattr(self, "_step_tokens", None)
        if tokens is None or "num_items_in_batch" not in batch:  # a custom train_epoch
            return metrics
        tokens.loss_sum += metrics.pop("loss") * batch["num_items_in_batch"]
        if batch_info.get("micro_step", 0) + 1 == batch_info.get("num_micro_steps", 1):
            (loss_sum,), _ = sum_over_workers([tokens.loss_sum], self.device)
            metrics["loss"] = loss_sum / max(tokens.tokens, 1.0)
        return metrics


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether ``model(**batch, num_items_in_batch=n)`` reaches the model's loss.

    transformers' own flag (``accepts_loss_kwargs``) where the model has one, else
    whether ``forward`` takes ``num_items_in_batch`` or ``**kwargs`` (peft's models
    pass theirs on to the base model).
    """
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag
    forward: Callable = model.forward
    parameters = inspect.signature(forward).parameters.values()
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch"
        for p in parameters
    )
