"""Weights a build left in the files (``polytrain.hf.from_pretrained``): each rank reads what it keeps.

A model built inside :func:`building` by ``polytrain.hf.from_pretrained`` has its
pretrained parameters allocated but not read (:mod:`polytrain.hf.loading`). Once
the backend has placed or sharded the model, each rank fills its own part of
every such parameter straight from the safetensors files: the whole tensor on a
replicated backend (:func:`fill_whole`), its range of the flattened tensor on a
sharded one (:func:`fill_ranges` with the backend's ranges; DeepSpeed ZeRO-3
fills its partitions itself). Tied parameters are read once. These helpers know
no backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from polytrain.errors import CheckpointError
from polytrain.hf.loading import building
from polytrain.hf.weights import file_backed, forget_sources

__all__ = [
    "building",
    "check_shape",
    "file_backed",
    "file_backed_params",
    "fill_ranges",
    "fill_whole",
    "forget_sources",
    "has_file_weights",
]


def has_file_weights(model: torch.nn.Module) -> bool:
    """Whether ``model`` has parameters still to be read from pretrained files."""
    return bool(file_backed(model))


def file_backed_params(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Parameter, Any, str]]:
    """``(param, source, key)`` once per parameter object still to be read from files."""
    backed = file_backed(model)
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in backed and id(param) not in seen:
            seen.add(id(param))
            yield param, *backed[name]


def check_shape(source: Any, key: str, shape: tuple[int, ...]) -> None:
    """Raise a :class:`~polytrain.errors.CheckpointError` unless the files' ``key`` has ``shape``."""
    found = source.weights.shape(key)
    if tuple(found) != tuple(shape):
        raise CheckpointError(
            f"{source.path!r} holds {key!r} with shape {tuple(found)}; the model's parameter has "
            f"shape {tuple(shape)}. The creator changed the pretrained model's shapes (e.g. "
            f"resize_token_embeddings) after from_pretrained: do that after loading in a "
            f"training step, or load a checkpoint of the final shapes."
        )


@torch.no_grad()
def fill_whole(model: torch.nn.Module) -> None:
    """Worker: read every file-backed parameter of ``model`` whole (this rank holds it whole)."""
    for param, source, key in file_backed_params(model):
        check_shape(source, key, tuple(param.shape))
        param.data.copy_(source.weights.read(key).reshape(param.shape))
    forget_sources(model)


@torch.no_grad()
def fill_ranges(
    model: torch.nn.Module,
    ranges: dict[int, Any] | None,
    local_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
) -> None:
    """Worker: read this rank's range of every file-backed parameter of a sharded ``model``.

    Args:
        model: the sharded model.
        ranges: ``id(param) -> range`` with ``shape``, ``start``, ``numel``, ``sharded``
            (fsdp's ``ParamRange``); a parameter without one is held whole.
        local_of: this rank's tensor of a parameter (default: a DTensor's local shard,
            else the parameter).
    """
    local_of = local_of or _local
    for param, source, key in file_backed_params(model):
        rng = (ranges or {}).get(id(param))
        shape = tuple(rng.shape) if rng is not None else tuple(param.shape)
        check_shape(source, key, shape)
        local = local_of(param)
        if rng is None or not rng.sharded:
            local.copy_(source.weights.read(key).reshape(local.shape))
        elif rng.numel:
            local.copy_(source.weights.read(key, rng.start, rng.numel).reshape(local.shape))
    forget_sources(model)


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param.data
