"""The default training step of the creator API (worker side): batches, losses, token counts, the step.

The default :class:`~polytrain.trainer_api.torch.operator.TrainingOperator` step takes
``(features..., target)`` tuples and, for real models, mapping batches
(``{"input_ids", "attention_mask", "labels"}``) passed as ``model(**batch)``. A
model whose output carries its own loss (an object with ``.loss`` such as a
HuggingFace ``ModelOutput``, or a dict with ``"loss"``) needs no ``loss_creator``.
Token batches also report ``num_tokens``: the tokens that train (the labels
that are not the ignore index; without labels the ``attention_mask`` sum).

The step itself (:func:`train_step`) is a forward between the operator's
``zero_grad`` / ``backward`` / ``step``, which ask the backend's strategy for
every part that differs between backends (skipping gradient sync, scaling the
loss, clipping the global norm, stepping) on the micro-batches that
:func:`micro_batches` groups into an optimizer step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from polytrain.backends.core.step_options import MicroBatch
from polytrain.errors import PolytrainError

#: The operator these functions serve (a TrainingOperator: it calls them, so they do not
#: import it back).
Operator = Any

#: The label value that losses skip (torch's CrossEntropyLoss and HF models).
IGNORE_INDEX = -100


class MissingLossError(PolytrainError, ValueError):
    """The default step has no loss: no ``loss_creator`` and the model's output carries none."""


def micro_batches(iterator: Iterable, k: int) -> Iterator[tuple[Any, MicroBatch]]:
    """``(batch, MicroBatch)`` in groups of ``k``; the last group may be shorter.

    A group is read before its first batch trains, so the step of a remainder at
    the end of an epoch knows its size (its loss is divided by that size).
    """
    batches = iter(iterator)
    while True:
        group = list(itertools.islice(batches, k))
        if not group:
            return
        for index, batch in enumerate(group):
            yield batch, MicroBatch(index, len(group))


def forward(operator: Operator, batch: Any) -> tuple[torch.Tensor, Any, Any]:
    """Run the model on one batch: ``(loss, output, target)`` under the backend's autocast.

    Mapping batches go in as ``model(**batch)``; tuples as ``model(*features)`` with
    a ``loss_creator`` (``criterion(output, target)``), or whole as ``model(*batch)``
    without one. Without a ``loss_creator`` the loss is the output's own
    (``output.loss`` or ``output["loss"]``); with one and a mapping batch it is
    ``criterion(output, batch["labels"])``.
    """
    criterion = operator.criterion
    with operator.autocast():
        if isinstance(batch, Mapping):
            output = operator.model(**batch)
            target = batch.get("labels")
        elif criterion is None:
            output = operator.model(*batch)
            target = batch[-1]
        else:
            *features, target = batch
            output = operator.model(*features)
        loss = criterion(output, target) if criterion is not None else model_loss(output)
    return loss, output, target


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself (``output.loss`` or ``output["loss"]``).

    Raises:
        MissingLossError: the output carries no loss.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise MissingLossError(
            f"The model returned {type(output).__name__} without a loss, and the trainer has no "
            f"loss_creator. Pass loss_creator (e.g. torch.nn.CrossEntropyLoss), give the model "
            f"its labels (HuggingFace models compute the loss from a 'labels' key in a dict "
            f"batch), or return an object with .loss or a dict with 'loss'."
        )
    return loss


def batch_counts(batch: Any, target: Any) -> dict[str, int]:
    """``num_samples`` (the batch's leading dimension) and, for token batches, ``num_tokens``."""
    counts = {"num_samples": _leading_dim(batch, target)}
    if isinstance(batch, Mapping):
        tokens = _num_tokens(batch)
        if tokens is not None:
            counts["num_tokens"] = tokens
    return counts


def _leading_dim(batch: Any, target: Any) -> int:
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
        return 1
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return int(target.shape[0])
    try:
        return len(target)
    except TypeError:
        return 1


def _num_tokens(batch: Mapping) -> int | None:
    # The trained tokens: a masked prompt or padding is read, not trained.
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return int((labels != IGNORE_INDEX).sum().item())
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum().item())
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return int(ids.numel())
    return None


def train_step(operator: Operator, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
    """The default ``train_batch``: one micro-batch, and the optimizer step after the last.

    ``operator.zero_grad()``, the forward, ``operator.backward(loss)``,
    ``operator.step()``: the operator's helpers divide the loss by the micro-batches
    of the step and skip gradient sync on all but the last, clip the global
    gradient norm (``max_grad_norm``, reported as ``grad_norm``) and step after the
    last (see :class:`~polytrain.trainer_api.torch.operator.TrainingOperator`).
    """
    operator.zero_grad()
    loss, output, target = forward(operator, batch)
    # The backward needs only what autograd saved: holding the output (a language model's
    # logits and key/value cache) through backward and step would add its size to the peak.
    del output
    operator.backward(loss)
    operator.step()
    return {"loss": loss.item(), **batch_counts(batch, target)}


def validate_step(operator: Operator, batch: Any) -> dict[str, Any]:
    """The default ``validate_batch``: ``val_loss``, counts, ``val_accuracy`` for class logits.

    A causal language model also reports ``val_perplexity`` (``exp`` of the loss).
    """
    loss, output, target = forward(operator, batch)
    stats: dict[str, Any] = {"val_loss": loss.item(), **batch_counts(batch, target)}
    if (
        isinstance(output, torch.Tensor)
        and output.dim() == 2
        and isinstance(target, torch.Tensor)
        and target.dim() == 1
        and not target.is_floating_point()
    ):
        stats["val_accuracy"] = (output.argmax(dim=1) == target).float().mean().item()
    if is_causal_lm(operator.strategy.unwrap_model(operator.model)):
        stats["val_perplexity"] = perplexity(stats["val_loss"])
    return stats


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` predicts the next token (HF ``*ForCausalLM`` / ``*LMHeadModel``)."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    can_generate = getattr(model, "can_generate", None)
    try:
        return bool(can_generate()) if callable(can_generate) else False
    except Exception:  # a user's method of the same name; not a language model then
        return False


def perplexity(loss: float) -> float:
    """``exp(loss)`` (inf where it overflows)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
