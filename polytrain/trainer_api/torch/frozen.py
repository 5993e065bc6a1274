"""Runs with frozen parameters (a LoRA fine-tune's base): optimizers and checkpoints over what trains.

Worker side. A parameter with ``requires_grad=False`` when the trainer starts is
never trained:

* :func:`trainable_optimizers`: the optimizers ``optimizer_creator`` built hold only
  trainable parameters (rebuilt without the frozen ones), so their state, ZeRO's
  master weights and fairscale OSS's per-step broadcasts cover the adapters only;
* :func:`frozen_entries` / :func:`without_frozen`: checkpoints leave the frozen
  parameters out and record, per model, their names and the base they come from
  (:data:`~polytrain.checkpoint.pieces.FROZEN_KEY`), so a checkpoint's size follows
  what trains; loading keeps the frozen values the model was built with
  (:func:`check_loadable` first makes sure they are the ones the checkpoint left out).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from polytrain.backends.core.sharding import constructor_defaults
from polytrain.checkpoint.pieces import FROZEN_KEY, Piece, left_out
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer_api.torch.model_info import clean_name

logger = logging.getLogger(__name__)


# -------------------------------------------------------------- optimizers
def trainable_optimizers(optimizers: Any, models: Any) -> list[torch.optim.Optimizer]:
    """Each optimizer over its trainable parameters only (rebuilt when it held frozen ones).

    Param groups keep their order and options (a group left without parameters stays,
    empty, so per-group schedules still line up).

    Raises:
        ConfigError: the models have no trainable parameter at all.
    """
    params = [p for model in models for p in model.parameters()]
    if params and not any(p.requires_grad for p in params):
        raise ConfigError(
            f"model_creator returned a model with no trainable parameter: all {len(params)} "
            f"parameters have requires_grad=False, so there is nothing to train. Unfreeze what "
            f"should train, or give peft_config= (LoRA adapters are created trainable)."
        )
    return [_without_frozen_params(optimizer) for optimizer in optimizers]


def _without_frozen_params(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    frozen = sum(1 for g in optimizer.param_groups for p in g["params"] if not p.requires_grad)
    if not frozen:
        return optimizer
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [p for p in g["params"] if p.requires_grad],
        }
        for g in optimizer.param_groups
    ]
    if not any(g["params"] for g in groups):
        raise ConfigError(
            f"optimizer_creator's {type(optimizer).__name__} holds only frozen parameters "
            f"({frozen}, requires_grad=False); it would never change anything. Give it the "
            f"trainable ones (e.g. [p for p in model.parameters() if p.requires_grad])."
        )
    logger.info(
        "%s: %d frozen parameter(s) left out; it optimizes the %d trainable one(s).",
        type(optimizer).__name__,
        frozen,
        sum(len(g["params"]) for g in groups),
    )
    return type(optimizer)(groups, **constructor_defaults(optimizer))


# -------------------------------------------------------------- checkpoints
def frozen_entries(operator: Any) -> list[dict[str, Any] | None]:
    """Per model: ``{"names": [...], "base": ...}`` of its frozen parameters (None: it has none).

    ``base`` is the pretrained checkpoint the model was built from, as the model says
    (its HF config's ``name_or_path``), or None.
    """
    entries: list[dict[str, Any] | None] = []
    for model in operator.components.models:
        module = operator.strategy.unwrap_model(model)
        names = sorted(
            {
                clean_name(name)
                for name, param in module.named_parameters(remove_duplicate=False)
                if not param.requires_grad
            }
        )
        entries.append({"names": names, "base": base_of(module)} if names else None)
    return entries


def base_of(module: Any) -> str | None:
    """The pretrained checkpoint ``module`` was built from (HF's ``name_or_path``), or None."""
    config = getattr(module, "config", None)
    found = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    return str(found) if found else None


def without_frozen(pieces: list[Piece], entries: list[dict[str, Any] | None]) -> list[Piece]:
    """The pieces of a rank's local state, the frozen parameters of every model left out."""
    frozen = [set((entry or {}).get("names") or ()) for entry in entries]
    if not any(frozen):
        return pieces
    return [
        p
        for p in pieces
        if not (
            p.path[0] == "models" and p.path[1] < len(frozen) and p.path[2] in frozen[p.path[1]]
        )
    ]


def drop_frozen(state: dict[str, Any], entries: list[dict[str, Any] | None]) -> dict[str, Any]:
    """A consolidated state without the frozen parameters, recording them under ``FROZEN_KEY``."""
    if not any(entries):
        return state
    models = []
    for index, model_state in enumerate(state["models"]):
        names = set((entries[index] or {}).get("names") or ()) if index < len(entries) else set()
        models.append({k: v for k, v in model_state.items() if k not in names})
    return {**state, "models": models, FROZEN_KEY: entries}


def check_loadable(saved: dict[str, Any], operator: Any) -> None:
    """Before loading a checkpoint that left frozen parameters out: this model keeps them frozen.

    A base other than the one recorded is logged (the path may have moved).

    Raises:
        CheckpointError: a left-out parameter is trained by this model, or missing from it.
    """
    live = frozen_entries(operator)
    for index, model in enumerate(operator.components.models):
        names = left_out(saved, index)
        if not names:
            continue
        entry = live[index] if index < len(live) else None
        mine = set((entry or {}).get("names") or ())
        module = operator.strategy.unwrap_model(model)
        known = {clean_name(n) for n, _ in module.named_parameters(remove_duplicate=False)}
        wrong = sorted(names - mine)
        if wrong:
            trained = [n for n in wrong if n in known]
            raise CheckpointError(
                f"The checkpoint left out {len(names)} frozen parameter(s) of model {index} (the "
                f"base is not saved with a run that does not train it); this model "
                + (
                    f"trains {len(trained)} of them ({', '.join(trained[:3])}...)"
                    if trained
                    else f"lacks {len(wrong)} of them ({', '.join(wrong[:3])}...)"
                )
                + ". Load it into the same model with the same parameters frozen (e.g. the same "
                "peft_config), or resume a full fine-tune from a checkpoint of one."
            )
        recorded = ((saved.get(FROZEN_KEY) or [])[index] or {}).get("base")
        if recorded and entry and entry.get("base") and recorded != entry["base"]:
            logger.warning(
                "The checkpoint was written with the frozen base %r; this model's base is %r. "
                "Its frozen weights are kept as loaded now.",
                recorded,
                entry["base"],
            )
