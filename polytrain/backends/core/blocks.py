"""Model surgery every torch backend shares, done on the worker before the backend wraps.

* :func:`repeated_blocks`: the classes a model repeats (a transformer's blocks), which
  FSDP wraps as units and activation checkpointing recomputes.
* :func:`apply_activation_checkpointing`: the ``activation_checkpointing=`` keyword.
  HF models use their own ``gradient_checkpointing_enable`` (non-reentrant); other
  models get the chosen blocks' ``forward`` replaced, on the instance, by a
  non-reentrant :func:`torch.utils.checkpoint.checkpoint` of it. Parameter names and
  state dicts stay as they were (unlike torch's ``CheckpointWrapper``, which adds a
  ``_checkpoint_wrapped_module.`` level to every name), so checkpoints, exports and
  FSDP's units are those of an unchecked run; ``fully_shard`` / DeepSpeed see the
  checkpointed block and wrap it as they would any module, as torchtitan orders it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from polytrain.errors import ConfigError

#: Marks a module whose forward this module made checkpointed (and the tests read).
CHECKPOINTED = "_polytrain_checkpointed"


def repeated_blocks(model: torch.nn.Module) -> set[type]:
    """The classes of the modules that a ``ModuleList`` of the model repeats (2+ alike, with parameters)."""
    classes: set[type] = set()
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and any(True for _ in module[0].parameters()):
            classes |= kinds
    return classes


def module_classes(model: torch.nn.Module) -> dict[str, type]:
    """The model's module classes by name (the root's included)."""
    return {type(m).__name__: type(m) for m in model.modules()}


def apply_activation_checkpointing(model: torch.nn.Module, spec: Any) -> list[str]:
    """Recompute activations in backward for ``spec``'s modules of ``model``, in place.

    Args:
        model: the user's model, not yet wrapped by a backend.
        spec: False/None (nothing), True (HF ``gradient_checkpointing_enable`` or the
            repeated blocks) or a tuple of module classes / class names.

    Returns:
        What was checkpointed: ``["<HF gradient checkpointing>"]`` or the class names.

    Raises:
        ConfigError: True for a model with neither, or a class (name) with no module in
            the model; the message names the value and the model's classes.
    """
    if not spec:
        return []
    if spec is True and callable(getattr(model, "gradient_checkpointing_enable", None)):
        if getattr(model, "supports_gradient_checkpointing", True):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            return ["<HF gradient checkpointing>"]
    classes = _checkpoint_classes(model, spec)
    for module in model.modules():
        if module is not model and isinstance(module, tuple(classes)):
            _checkpoint_forward(module)
    return sorted(cls.__name__ for cls in classes)


def _checkpoint_classes(model: torch.nn.Module, spec: Any) -> set[type]:
    by_name = module_classes(model)
    if spec is True:
        found = repeated_blocks(model)
        if not found:
            raise ConfigError(
                f"activation_checkpointing=True found neither HF gradient checkpointing "
                f"(gradient_checkpointing_enable) nor repeated blocks (a ModuleList of 2+ modules "
                f"of one class) in {type(model).__name__}. Its module classes: {sorted(by_name)}. "
                f"Name the classes to recompute, e.g. activation_checkpointing=['MyBlock']."
            )
        return found
    classes: set[type] = set()
    for item in spec:
        cls = by_name.get(item) if isinstance(item, str) else item
        name = item if isinstance(item, str) else getattr(item, "__name__", repr(item))
        if cls is None or not any(isinstance(m, cls) for m in model.modules() if m is not model):
            raise ConfigError(
                f"activation_checkpointing names {name!r}, but {type(model).__name__} has no "
                f"submodule of that class. Its module classes: {sorted(by_name)}. Name one of "
                f"them (a repeated block such as a transformer layer), or pass True."
            )
        classes.add(cls)
    return classes


def _checkpoint_forward(module: torch.nn.Module) -> None:
    if getattr(module, CHECKPOINTED, False):
        return
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword inputs, inputs that need no grad, and
        # FSDP2 / DeepSpeed ZeRO-3 parameters gathered by hooks around the module's call.
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    setattr(module, CHECKPOINTED, True)
