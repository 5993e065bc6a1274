"""Which submodules become FSDP units (v1 and v2): the ``auto_wrap_policy`` option.

* ``"auto"`` (default): the repeated blocks of a model (:func:`repeated_blocks`:
  the class of the modules in a ``ModuleList`` of two or more same-class
  modules, e.g. GPT-2's ``GPT2Block``) when it has them, else ``"size_based"``.
  Wrapping only the blocks keeps tied weights (GPT-2's ``transformer.wte`` and
  ``lm_head``) together in the root unit: a size-based unit holding only one of
  them breaks the tie (FSDP2 refuses it, FSDP1 fails with a size mismatch).
* ``"transformer"``: the repeated blocks; an error if the model has none.
* a list of module classes or class names (``["GPT2Block"]``): every module of
  those classes.
* ``"size_based"``: every submodule tree with at least ``min_num_params``
  parameters; ``"none"``: the whole model is one unit.

Strings and classes are checked when the trainer is built; class names are
looked up in the model on the workers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from polytrain.backends.core.blocks import repeated_blocks
from polytrain.errors import ConfigError

__all__ = ["block_classes", "block_units", "fsdp1_policy", "repeated_blocks"]


def block_classes(model: torch.nn.Module, policy: Any) -> set[type] | None:
    """The classes whose modules become units under ``policy`` (None: a size or no policy).

    Raises:
        ConfigError: ``"transformer"`` for a model without repeated blocks, or a class
            name that no module of the model has.
    """
    if policy in ("size_based", "none"):
        return None
    if policy in ("auto", "transformer"):
        found = repeated_blocks(model)
        if not found and policy == "transformer":
            raise ConfigError(
                f"auto_wrap_policy='transformer' found no repeated blocks in "
                f"{type(model).__name__} (a ModuleList of 2+ modules of one class). Name the "
                f"block classes, e.g. auto_wrap_policy=['MyBlock'], or use 'size_based'."
            )
        return found or None
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    classes = set()
    for item in policy:
        if isinstance(item, str):
            if item not in by_name:
                raise ConfigError(
                    f"auto_wrap_policy names {item!r}, but {type(model).__name__} has no module "
                    f"of that class. Its module classes: {sorted(by_name)}. Name one of them."
                )
            item = by_name[item]
        classes.add(item)
    return classes


def block_units(model: torch.nn.Module, classes: set[type]) -> list[torch.nn.Module]:
    """The modules of ``classes`` below the root, children before parents."""
    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is not model and isinstance(module, tuple(classes)):
            units.append(module)

    visit(model)
    return units


def fsdp1_policy(model: torch.nn.Module, policy: Any, min_num_params: int) -> Any:
    """FSDP1's ``auto_wrap_policy`` argument for ``model``."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    classes = block_classes(model, policy)
    if classes:
        return ModuleWrapPolicy(classes)
    if policy == "none":
        return None
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
