"""PEFT adapters on a pretrained model: the trainer's ``peft_config=`` and what an export needs to know.

``TorchTrainer(peft_config=LoraConfig(...))`` wraps the model ``model_creator``
builds with ``peft.get_peft_model`` wherever it is built (:class:`PeftCreator`):
on the workers, inside the backend's build (the adapters are created on the meta
device or partitioned by ZeRO-3 with the base) and on the driver
(``get_model()``). A model the creator wraps itself trains the same way.

:func:`adapter_info` describes a PEFT model without touching a tensor, for the
exports (:mod:`polytrain.hf.export`): PEFT's own file name of every adapter
tensor (``peft.get_peft_model_state_dict``'s renaming), ``adapter_config.json``,
the base model's name of every other tensor, and the merge of every LoRA layer
(``W + scaling * B @ A``, PEFT's ``get_delta_weight``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from polytrain.compat.imports import require
from polytrain.errors import ConfigError, ConfigTypeError, CreatorError

#: Name segments PEFT inserts into the base model's parameter names.
_BASE_PREFIX = "base_model.model."
_WRAPPED = ".base_layer"
_LINEAR_KINDS = ("Linear", "Conv1D")


# ------------------------------------------------------------------ config
def resolve_peft_config(value: Any) -> Any:
    """Driver: ``peft_config`` as a ``peft.PeftConfig`` (None stays None).

    Args:
        value: a ``peft.PeftConfig`` (``LoraConfig(...)``), or a dict of one with its
            ``peft_type`` (``{"peft_type": "LORA", "r": 8, "target_modules": [...]}``, as a
            YAML run config writes it).

    Raises:
        ConfigTypeError: another type.
        ConfigError: a dict ``peft`` rejects.
    """
    if value is None:
        return None
    peft = require("peft", "peft_config")
    if isinstance(value, peft.PeftConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigTypeError(
            f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig(r=8, "
            f"target_modules=['q_proj', 'v_proj'])) or a dict of one with its peft_type; got "
            f"{type(value).__name__} ({value!r})."
        )
    if "peft_type" not in value:
        raise ConfigError(
            f"peft_config={value!r} has no 'peft_type'; add one, e.g. 'peft_type': 'LORA'."
        )
    try:
        return peft.get_peft_config(dict(value))
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"peft rejected peft_config={value!r}: {exc}") from None


class PeftCreator:
    """``model_creator`` with ``peft.get_peft_model(model, peft_config)`` applied to its model.

    Args:
        model_creator: the user's creator (one model).
        peft_config: a ``peft.PeftConfig``.
    """

    def __init__(self, model_creator: Any, peft_config: Any) -> None:
        self.model_creator = model_creator
        self.peft_config = peft_config

    def __call__(self, config: dict[str, Any]) -> Any:
        model = self.model_creator(config)
        if isinstance(model, (list, tuple)):
            raise CreatorError(
                f"peft_config wraps one model, but model_creator returned {len(model)}; apply "
                f"peft.get_peft_model to the one to adapt inside model_creator instead."
            )
        return apply_peft(model, self.peft_config)


def apply_peft(model: Any, peft_config: Any) -> Any:
    """``peft.get_peft_model(model, peft_config)``; a ``target_modules`` that matches nothing is named.

    Raises:
        ConfigError: ``target_modules`` matches no module of ``model`` (the message lists
            the names it could use), or the model already has adapters.
    """
    peft = require("peft", "peft_config")
    if is_peft_model(model):
        raise ConfigError(
            f"model_creator already returned a PEFT model ({type(model).__name__}); give "
            f"peft_config= or call get_peft_model in the creator, not both."
        )
    try:
        return peft.get_peft_model(model, peft_config)
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "Target module" not in str(exc):
            raise
        raise ConfigError(
            f"peft_config's target_modules={_targets(peft_config)!r} matches no module of "
            f"{type(model).__name__}. Its layers that LoRA can adapt are named "
            f"{adaptable_names(model)}; use some of those names (or 'all-linear')."
        ) from None


def _targets(peft_config: Any) -> Any:
    targets = getattr(peft_config, "target_modules", None)
    return sorted(targets) if isinstance(targets, (set, frozenset)) else targets


def adaptable_names(model: Any) -> list[str]:
    """The last name segment of every ``Linear`` / ``Conv1D`` / ``Embedding`` module of ``model``."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and type(module).__name__ in (*_LINEAR_KINDS, "Embedding")
    }
    return sorted(names)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (``get_peft_model``'s wrapper)."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(
        getattr(model, "get_base_model", None)
    )


def check_quantized(model: Any, device_type: str) -> None:
    """Worker: a 4/8-bit quantized base (QLoRA) is refused on a CPU worker, with the reason.

    Raises:
        ConfigError: ``model`` holds quantized weights and the worker has no GPU.
    """
    if device_type == "cuda":
        return
    base = model.get_base_model() if is_peft_model(model) else model
    quantized = bool(getattr(base, "is_quantized", False)) or any(
        getattr(base, flag, False) for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit")
    )
    if quantized:
        raise ConfigError(
            f"model_creator returned a 4/8-bit quantized {type(base).__name__} (QLoRA); its "
            f"quantized kernels (bitsandbytes) run on CUDA GPUs only and this worker is on the "
            f"CPU. Train it with use_gpu=True, or load the base unquantized for LoRA on CPU."
        )


# ------------------------------------------------------------------ export
def adapter_info(model: Any, keys: list[str]) -> dict[str, Any]:
    """What exporting the PEFT model ``model`` needs, from the live model (no tensor is read).

    Args:
        model: the PEFT model (unwrapped: the module ``get_peft_model`` returned).
        keys: its state-dict keys (wrapper segments removed), in order.

    Returns:
        ``{"adapter_name", "peft_type", "files": {"adapter_config.json": text}, "keys": {model
        key: PEFT's key}, "base": the base's path or name, "base_keys": {model key: the base
        model's key}, "layers": {base key: merge of one LoRA layer}, "unmergeable": reason
        or None}``.
    """
    name = _adapter_name(model)
    config = model.peft_config[name]
    return {
        "adapter_name": name,
        "peft_type": str(getattr(config.peft_type, "value", config.peft_type)),
        "files": _config_files(config),
        "keys": peft_keys(model, keys, name),
        "base": getattr(config, "base_model_name_or_path", None),
        "base_keys": base_keys(keys, name),
        "layers": _lora_layers(model, name),
        "unmergeable": _unmergeable(model, config, name),
    }


def _adapter_name(model: Any) -> str:
    names = list(model.peft_config)
    if len(names) != 1:
        raise ConfigError(
            f"The PEFT model has {len(names)} adapters ({names}); an export writes one. Delete "
            f"the others (model.delete_adapter(name)) in model_creator."
        )
    return names[0]


def _config_files(config: Any) -> dict[str, str]:
    return files_written(config.save_pretrained)


def files_written(*writers: Any) -> dict[str, str]:
    """``{file name: text}`` of what the ``save_pretrained``-like ``writers`` write into a folder."""
    with tempfile.TemporaryDirectory(prefix="polytrain-hf-files-") as folder:
        for write in writers:
            write(folder)
        files = {}
        for file_name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, file_name), encoding="utf-8") as handle:
                files[file_name] = handle.read()
    return files


def peft_keys(model: Any, keys: list[str], adapter_name: str) -> dict[str, str]:
    """``{model key: key in adapter_model.safetensors}``: PEFT's own selection and renaming.

    ``peft.get_peft_model_state_dict`` is run on placeholders (meta tensors), so it
    decides which tensors belong to the adapter and how it names them.
    """
    import torch

    peft = require("peft", "Exporting a PEFT adapter")
    placeholders = {key: torch.empty(0, device="meta") for key in keys}
    by_id = {id(value): key for key, value in placeholders.items()}
    chosen = peft.get_peft_model_state_dict(model, placeholders, adapter_name)
    return {by_id[id(value)]: key for key, value in chosen.items() if id(value) in by_id}


def base_keys(keys: list[str], adapter_name: str) -> dict[str, str]:
    """``{model key: the base model's key}`` for every tensor of the merged model.

    LoRA's own tensors are left out; a ``modules_to_save`` copy replaces its original.
    """
    found: dict[str, str] = {}
    saved_copy = f".modules_to_save.{adapter_name}."
    for key in keys:
        plain = key.removeprefix(_BASE_PREFIX).replace(_WRAPPED, "")
        if ".lora_" in plain or ".original_module." in plain:
            continue
        if ".modules_to_save." in key and saved_copy not in key:
            continue  # another adapter's copy
        found[key] = plain.replace(saved_copy, ".")
    return found


def _lora_layers(model: Any, adapter_name: str) -> dict[str, dict[str, Any]]:
    """``{base weight key: how its LoRA update merges}`` for every LoRA layer of the adapter."""
    layers: dict[str, dict[str, Any]] = {}
    for module_name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        embedding_a = getattr(module, "lora_embedding_A", None)
        if not any(adapter_name in (d or {}) for d in (lora_a, embedding_a)):
            continue
        path = _clean(module_name)
        base = path.removeprefix(_BASE_PREFIX)
        entry: dict[str, Any] = {"scaling": float(module.scaling[adapter_name])}
        if lora_a is not None and adapter_name in lora_a:
            entry.update(
                kind="linear",
                A=f"{path}.lora_A.{adapter_name}.weight",
                B=f"{path}.lora_B.{adapter_name}.weight",
                fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)),
            )
            if (getattr(module, "lora_bias", {}) or {}).get(adapter_name):
                entry["bias"] = f"{path}.lora_B.{adapter_name}.bias"
                entry["base_bias"] = f"{base}.bias"
        else:
            entry.update(
                kind="embedding",
                A=f"{path}.lora_embedding_A.{adapter_name}",
                B=f"{path}.lora_embedding_B.{adapter_name}",
            )
        layers[f"{base}.weight"] = entry
    return layers


def _unmergeable(model: Any, config: Any, adapter_name: str) -> str | None:
    """Why the adapter cannot be merged into the base weights here (None: it can)."""
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "LORA":
        return f"its PEFT type is {peft_type}; a merged export supports LoRA"
    for module_name, module in model.named_modules():
        if adapter_name in (getattr(module, "lora_variant", None) or {}):
            variant = type(module.lora_variant[adapter_name]).__name__
            return f"layer {module_name!r} uses the LoRA variant {variant} (e.g. DoRA)"
        lora_a = getattr(module, "lora_A", None) or {}
        if adapter_name in lora_a and type(module).__name__ not in ("Linear", "Embedding"):
            return f"layer {module_name!r} is a LoRA {type(module).__name__}"
        biased = (getattr(module, "lora_bias", None) or {}).get(adapter_name)
        if biased and getattr(module.get_base_layer(), "bias", None) is None:
            return f"layer {module_name!r} has lora_bias, but its base layer has no bias"
    return None


def _clean(name: str) -> str:
    for segment in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(segment, "")
    return name


def adapter_config_json(info: dict[str, Any]) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a dict."""
    return json.loads(info["files"]["adapter_config.json"])
