"""What an export of a model needs to know that its tensors do not say (worker side).

Recorded in every checkpoint the workers write (the ``export_info`` entry of its
meta, one per model), so that ``polytrain checkpoint convert --to safetensors``
writes offline what ``trainer.save_pretrained`` writes:

- ``keys``: the ``state_dict`` keys in order (the shard plan follows it, as HF's does);
- ``buffers``: the persistent buffers (the index counts parameters only);
- ``drop``: ``{dropped name: kept name}`` for tensors the model shares (tied weights):
  chosen as ``transformers``' ``save_pretrained`` does for an HF model (names that
  match a ``_tied_weights_keys`` entry go), as ``safetensors.torch.save_model`` does
  otherwise (the alphabetically first name stays);
- ``files``: ``config.json`` (and ``generation_config.json`` for a model that
  generates), written by the model's own HF config classes.
"""

from __future__ import annotations

import copy
import logging
import re
import sys
from typing import Any

from polytrain.checkpoint.pieces import persistent_buffers
from polytrain.errors import ConfigError
from polytrain.hf import adapters

logger = logging.getLogger(__name__)

#: Wrapper modules whose names appear in parameter names but not in checkpoint keys.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def export_info(model: Any, strict: bool = True) -> dict[str, Any]:
    """Worker: the export info of ``model`` (the user's module, unwrapped; no communication).

    Args:
        model: the user's module.
        strict: raise when the model's HF config cannot be written; False (an ordinary
            checkpoint save, which must not fail for an export's sake) logs a warning
            and records no config files instead.
    """
    named = _named_tensors(model)
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    shared = [sorted(set(names)) for names in groups.values() if len(set(names)) > 1]
    patterns = _tied_patterns(model)
    drop: dict[str, str] = {}
    for names in shared:
        drop.update(_drop_hf(names, patterns) if patterns else _drop_plain(names))
    info = {
        "keys": list(dict.fromkeys(name for name, _ in named)),
        "buffers": [name for name, _ in persistent_buffers(model, rename=clean_name)],
        "drop": drop,
    }
    if adapters.is_peft_model(model):
        # No HF model as it stands: its exports are the adapter, or merged into the base.
        info["files"] = {}
        info["peft"] = _peft_info(model, info) if strict else _or_warn(_peft_info, model, info)
    else:
        info["files"] = hf_files(model) if strict else (_or_warn(hf_files, model) or {})
    return info


def _peft_info(model: Any, info: dict[str, Any]) -> dict[str, Any]:
    """The PEFT entry: the adapter's layout, and the merged model's keys, ties and HF files."""
    peft = adapters.adapter_info(model, info["keys"])
    rename = peft["base_keys"]
    peft["merged"] = {
        "keys": [rename[k] for k in info["keys"] if k in rename],
        "buffers": [rename[k] for k in info["buffers"] if k in rename],
        "drop": {
            rename[k]: rename[v] for k, v in info["drop"].items() if k in rename and v in rename
        },
        "files": hf_files(model.get_base_model()),
    }
    return peft


def _or_warn(build: Any, *args: Any) -> Any:
    """``build(*args)``, or None with a warning: an ordinary checkpoint must not fail for an export."""
    try:
        return build(*args)
    except Exception as exc:  # noqa: BLE001 (any failure of the user's config classes)
        logger.warning(
            "What an export of the model needs could not be recorded (%s: %s); `polytrain "
            "checkpoint convert` cannot write it in the Hugging Face or PEFT layout from this "
            "checkpoint.",
            type(exc).__name__,
            exc,
        )
        return None


def clean_name(name: str) -> str:
    """A parameter or buffer name as checkpoints key it: wrapper modules' segments dropped."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _named_tensors(model: Any) -> list[tuple[str, Any]]:
    """``(state_dict key, tensor object)`` in ``state_dict`` order, shared ones under every name."""
    found = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None and not name.startswith("_flat_param"):
                found.append((clean_name(prefix + name), param))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.append((clean_name(prefix + name), buffer))
    return found


def _tied_patterns(model: Any) -> list[str]:
    """HF's declared tied-weight names (``_tied_weights_keys`` of every submodule), as patterns."""
    patterns: list[str] = []
    for name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{clean_name(name)}.{key}" if name else key for key in tied]
    return patterns


def _drop_hf(names: list[str], patterns: list[str]) -> dict[str, str]:
    """transformers' ``remove_tied_weights_from_state_dict``: the declared targets go, one name stays."""
    dropped, found = [], 0
    for name in names:
        if any(re.search(pattern, name) for pattern in patterns):
            found += 1
            if found < len(names):
                dropped.append(name)
    kept = [name for name in names if name not in dropped]
    if len(kept) > 1:  # undeclared sharing: keep one, as safetensors does
        return {**{name: kept[0] for name in dropped}, **_drop_plain(kept)}
    return {name: kept[0] for name in dropped}


def _drop_plain(names: list[str]) -> dict[str, str]:
    """``safetensors.torch.save_model``: the alphabetically first name stays."""
    return {name: names[0] for name in names[1:]}


def hf_files(model: Any) -> dict[str, str]:
    """``{file name: text}`` of the HF config files ``save_pretrained`` would write; {} for other models.

    The config is a copy with ``architectures`` and ``dtype`` set, as HF's
    ``save_pretrained`` sets them on the model's own config before writing it.
    """
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return {}
    _require_transformers_model(model, config)
    config = copy.deepcopy(config)
    dtype = getattr(model, "dtype", None)
    if dtype is not None and hasattr(config, "dtype"):
        config.dtype = str(dtype).split(".")[-1]
    # FSDP2 renames the class of a fully_shard-ed module (FSDPGPT2LMHeadModel).
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    writers = [config.save_pretrained]
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        writers.append(generation.save_pretrained)
    return adapters.files_written(*writers)


def _require_transformers_model(model: Any, config: Any) -> None:
    """A module with an HF config that is no ``transformers`` model would be loaded wrongly.

    ``from_pretrained`` builds the config's architecture and matches tensors by name: a
    wrapper's names carry its own prefixes, so none would load, without an error.

    Raises:
        ConfigError: ``model`` is not a ``transformers`` ``PreTrainedModel``.
    """
    transformers = sys.modules.get("transformers")
    base = getattr(getattr(transformers, "modeling_utils", None), "PreTrainedModel", None)
    if base is not None and isinstance(model, base):
        return
    raise ConfigError(
        f"{type(model).__name__} is not a transformers model but carries one's config "
        f"({type(config).__name__}): from_pretrained would build that architecture and find "
        f"none of this module's tensors (their names carry {type(model).__name__}'s own "
        f"prefixes), without an error. Return the transformers model itself from "
        f"model_creator (put the rest into the loss or the operator), or write the weights "
        f"with safetensors.torch.save_model."
    )
