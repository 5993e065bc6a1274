"""A PEFT model out: its adapter in PEFT's layout, or merged into its base in HF's layout.

Both read the model's tensors one at a time from a
:class:`~polytrain.checkpoint.safetensors_export.ModelTensors` (the directory the
workers just wrote, or a checkpoint) and write a new directory atomically:

* :func:`write_adapter`: ``adapter_model.safetensors`` (PEFT's tensor names, as
  ``PeftModel.save_pretrained`` writes them) and ``adapter_config.json``:
  ``PeftModel.from_pretrained(base, path)`` loads it;
* :func:`write_merged`: every LoRA layer's ``W + scaling * B @ A`` (PEFT's
  ``merge_and_unload``) under the base model's names, in shards with HF's index
  and the base's ``config.json``: ``AutoModelForCausalLM.from_pretrained(path)``
  loads it. The base's tensors come from the same source, or, for a checkpoint
  that left them out (a run with a frozen base), from the base's own directory.

The layout facts come from :func:`polytrain.hf.adapters.adapter_info`, recorded
by the live model when the tensors were written.
"""

from __future__ import annotations

import os
from typing import Any

from polytrain.checkpoint import safetensors_export as st
from polytrain.compat.imports import require
from polytrain.errors import CheckpointError, ConfigError
from polytrain.hf.weights import SafetensorsDir, WeightsSource

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_section(info: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """The PEFT part of a model's export info.

    Raises:
        ConfigError: the model has no adapters (``what`` names the export asked for).
    """
    peft = (info or {}).get("peft")
    if not peft:
        raise ConfigError(
            f"{what} writes a PEFT adapter, but this model has none (it is not a peft model: "
            f"no get_peft_model in model_creator and no peft_config=). Export the whole model "
            f"in the Hugging Face layout instead (save_pretrained without merge, or convert "
            f"--to safetensors)."
        )
    return peft


def write_adapter(tensors: st.ModelTensors, peft: dict[str, Any], dst: str | os.PathLike) -> dict:
    """Write the adapter in PEFT's layout into ``dst`` (new or empty).

    Returns:
        ``{"path", "files", "total_size"}``.

    Raises:
        CheckpointError: an adapter tensor is missing from ``tensors``.
    """
    target = st.check_target(dst)
    storage = require("safetensors.torch", "Writing a PEFT adapter")
    missing = [key for key in peft["keys"] if key not in tensors.shape_dtype]
    if missing:
        raise CheckpointError(
            f"The adapter tensors {missing[:3]} are not in the checkpoint; it was written by "
            f"another model."
        )
    weights = {name: tensors.read(key).contiguous() for key, name in peft["keys"].items()}
    with st.staged(target) as tmp:
        storage.save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        for name, text in peft["files"].items():
            st.write_text(tmp / name, text)
    return {
        "path": str(target),
        "files": sorted([ADAPTER_WEIGHTS, *peft["files"]]),
        "total_size": sum(t.numel() * t.element_size() for t in weights.values()),
    }


def merged_tensors(
    tensors: st.ModelTensors, peft: dict[str, Any], base: str | os.PathLike | None = None
) -> st.ModelTensors:
    """The merged model's tensors under the base model's names, read (and merged) one at a time.

    Args:
        tensors: the PEFT model's tensors (a checkpoint's may lack the frozen base).
        peft: the model's :func:`~polytrain.hf.adapters.adapter_info`.
        base: the base's HF directory, read for the tensors ``tensors`` lacks (default: the
            base the adapter names).

    Raises:
        ConfigError: the adapter cannot be merged (its reason).
        CheckpointError: a base tensor is neither in ``tensors`` nor in the base directory.
    """
    if peft.get("unmergeable"):
        raise ConfigError(
            f"The adapter cannot be merged into its base: {peft['unmergeable']}. Export the "
            f"adapter itself (save_pretrained without merge) and merge it with peft."
        )
    names, shapes, sources = [], {}, {}
    fallback = None
    tied = (peft.get("merged") or {}).get("drop") or {}  # written once, under the kept name
    for key, name in peft["base_keys"].items():
        if key not in tensors.shape_dtype and name in tied:
            continue
        if key in tensors.shape_dtype:
            shapes[name], sources[name] = tensors.shape_dtype[key], key
        else:
            fallback = fallback or _base_source(base or peft.get("base"), key)
            found = fallback.key_for(name)
            if found is None:
                raise CheckpointError(
                    f"{name!r} is neither in the checkpoint nor in the base {fallback.path!r}; "
                    f"give the base model's directory (--base) it was trained from."
                )
            shapes[name] = (fallback.weights.shape(found), fallback.weights.dtype(found))
            sources[name] = (fallback, found)
        names.append(name)

    def read(name: str) -> Any:
        source = sources[name]
        if isinstance(source, tuple):
            value = source[0].weights.read(source[1]).reshape(shapes[name][0])
        else:
            value = tensors.read(source)
        layer = peft["layers"].get(name)
        return _merge(value, layer, tensors) if layer else _merge_bias(value, name, peft, tensors)

    return st.ModelTensors(names, shapes, read)


def _base_source(base: Any, key: str) -> WeightsSource:
    if not base:
        raise CheckpointError(
            f"The checkpoint left the frozen base out ({key!r} is not in it) and names no base "
            f"directory; give the base model's directory (--base DIR)."
        )
    return WeightsSource(SafetensorsDir(base))


def _merge(weight: Any, layer: dict[str, Any], tensors: st.ModelTensors) -> Any:
    """PEFT's ``merge``: ``W + transpose(B @ A, fan_in_fan_out) * scaling`` (LoRA Linear / Conv1D).

    An Embedding's A and B are transposed (``lora_embedding_A``: r x vocabulary).
    Half-precision weights merge in float32, as PEFT does on the CPU.
    """
    a, b = tensors.read(layer["A"]), tensors.read(layer["B"])
    low = weight.dtype in (_torch().float16, _torch().bfloat16)
    if low:
        a, b = a.float(), b.float()
    delta = b @ a
    if layer["kind"] == "embedding" or layer.get("fan_in_fan_out"):
        delta = delta.T
    delta = delta * layer["scaling"]
    return weight + delta.to(weight.dtype)


def _merge_bias(value: Any, name: str, peft: dict[str, Any], tensors: st.ModelTensors) -> Any:
    """A base bias that a LoRA layer with ``lora_bias`` adds to (``bias + B.bias * scaling``)."""
    for layer in peft["layers"].values():
        if layer.get("base_bias") == name:
            return value + tensors.read(layer["bias"]) * layer["scaling"]
    return value


def _torch() -> Any:
    import torch

    return torch


def write_merged(
    tensors: st.ModelTensors,
    info: dict[str, Any],
    dst: str | os.PathLike,
    max_shard_size: int | str = st.DEFAULT_MAX_SHARD_SIZE,
    base: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write the PEFT model merged into its base, in HF's layout, into ``dst`` (new or empty).

    Args:
        tensors: the PEFT model's tensors.
        info: the model's export info (its ``peft`` entry and the base's ``merged`` files).
        dst: the export directory.
        max_shard_size: bytes per safetensors file.
        base: the base's HF directory, for tensors ``tensors`` lacks.

    Returns:
        ``{"path", "files", "sharded", "total_size"}``.
    """
    peft = peft_section(info, "merge=True")
    merged = merged_tensors(tensors, peft, base)
    return st.write_pretrained(merged, peft.get("merged") or {}, dst, max_shard_size)


def export_adapter(
    src: str | os.PathLike, dst: str | os.PathLike, model_index: int = 0
) -> dict[str, Any]:
    """Offline: the adapter of a PEFT model's checkpoint (directory or file) in PEFT's layout.

    Raises:
        ConfigError: the checkpoint's model has no adapters.
        CheckpointError: ``src`` is not a readable checkpoint, or ``dst`` is not new or empty.
    """
    st.check_target(dst)
    with st.checkpoint_model(src, model_index) as (tensors, info):
        return write_adapter(tensors, peft_section(info, "--to peft"), dst)


def export_merged(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_shard_size: int | str = st.DEFAULT_MAX_SHARD_SIZE,
    model_index: int = 0,
    base: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Offline: a PEFT model's checkpoint merged into its base, in HF's layout.

    A checkpoint of a run with a frozen base holds no base: it is read from ``base``
    (default: the directory the adapter's config names).

    Raises:
        ConfigError: the checkpoint's model has no adapters, or they cannot be merged.
        CheckpointError: ``src`` is not readable, the base is missing, or ``dst`` is not new or empty.
    """
    st.check_target(dst)
    st.parse_max_shard_size(max_shard_size)
    with st.checkpoint_model(src, model_index) as (tensors, info):
        return write_merged(tensors, info or {}, dst, max_shard_size, base)
