"""Pretrained models in a ``model_creator``: built without their weights, filled from the files later.

``polytrain.hf.from_pretrained(path)`` (or the creator ``polytrain.hf.pretrained(path)``)
loads an HF checkpoint directory. Called in a worker while a backend builds the
models, it builds only the model's structure (the parameters allocated, not
read) and marks where the weights are (:class:`~polytrain.hf.weights.WeightsSource`);
once the backend has sharded the model, each rank reads only its own part of
every tensor from the safetensors files. Anywhere else (the driver's
``get_model()``, a script) it is ``transformers``' own ``from_pretrained``.

How a build goes is the backend's choice, told through :func:`building`:

* ``"empty"``: parameters on the CPU without values (allocated lazily: untouched pages
  take no memory), buffers computed as usual; the rest of the creator (``peft``'s
  ``get_peft_model``, a new head) runs for real on them.
* ``"meta"``: the creator runs under ``torch.device("meta")`` (fsdp's non-zero ranks).
* ``"zero3"``: the creator runs inside ``deepspeed.zero.Init`` (partitioned as built).

Under ``"meta"`` and ``"zero3"`` the build is discarded except for its shapes, and
``transformers``' own ``from_pretrained`` (which refuses the meta device, and
under a bare ``zero.Init`` reads every weight into empty partitions) builds the
structure only, too (:func:`structure_only`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from polytrain.compat.imports import require
from polytrain.errors import CheckpointError, ConfigError
from polytrain.hf.weights import SOURCE_ATTR, SafetensorsDir, WeightsSource

BUILD_MODES = ("empty", "meta", "zero3")
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "polytrain_hf_build", default=None
)

#: from_pretrained keywords that load weights differently than from the files as they are.
_REFUSED = ("device_map", "state_dict", "gguf_file", "distributed_config", "tp_plan", "tp_size",
            "device_mesh", "key_mapping", "offload_folder", "max_memory", "subfolder", "variant", "output_loading_info")  # fmt: skip
_QUANTIZED = ("quantization_config", "load_in_4bit", "load_in_8bit")
#: from_pretrained keywords about where files come from: the config loader takes them.
_HUB = ("cache_dir", "revision", "local_files_only", "token", "force_download", "proxies",
        "trust_remote_code", "code_revision")  # fmt: skip
#: from_pretrained keywords with nothing to do when no weight is read.
_IGNORED = ("use_safetensors", "weights_only", "_from_auto", "_from_pipeline", "low_cpu_mem_usage",
            "disable_mmap", "adapter_kwargs")  # fmt: skip


def build_mode() -> str | None:
    """How the current build makes pretrained models (None: not inside a backend's build)."""
    return _MODE.get()


@contextlib.contextmanager
def building(mode: str) -> Iterator[None]:
    """Worker: within, :func:`from_pretrained` builds the structure only (``mode``: see the module).

    ``"meta"`` and ``"zero3"`` also make ``transformers``' ``from_pretrained`` build the
    structure only (:func:`structure_only`).
    """
    if mode not in BUILD_MODES:
        raise ValueError(f"mode must be one of {BUILD_MODES}; got {mode!r}.")
    token = _MODE.set(mode)
    try:
        with structure_only() if mode != "empty" else contextlib.nullcontext():
            yield
    finally:
        _MODE.reset(token)


# ------------------------------------------------------------------ public
def from_pretrained(
    path: str | os.PathLike, model_class: Any = None, **kwargs: Any
) -> torch.nn.Module:
    """An HF model from the checkpoint directory ``path``; sharded straight from the files on workers.

    Inside a ``model_creator`` running on the workers, the model is built without its
    weights, and the backend fills each rank's part of every parameter from the
    safetensors files after sharding (fsdp: the local shard of each parameter,
    DeepSpeed ZeRO-3: each rank's partition, ddp / horovod / fairscale: the whole
    model, every rank reading). Everything the creator does after this call (``peft``'s
    ``get_peft_model``, a new head) runs as usual. Elsewhere it is
    ``model_class.from_pretrained(path, **kwargs)``.

    Args:
        path: a directory ``save_pretrained`` wrote: ``config.json`` and
            ``model.safetensors`` or shards with ``model.safetensors.index.json``.
        model_class: an HF class with ``from_pretrained`` (default:
            ``transformers.AutoModelForCausalLM``).
        **kwargs: ``from_pretrained``'s keywords: ``dtype``, ``attn_implementation``,
            ``config``, config overrides, ``trust_remote_code``, ``revision``...

    Returns:
        The model, in eval mode as ``from_pretrained`` returns it (the trainer switches
        it to training).

    Raises:
        CheckpointError: ``path`` holds no safetensors weights, or lacks some of the
            model's parameters (which ``from_pretrained`` would initialise at random).
        ConfigError: a 4/8-bit quantized load without a CUDA GPU, or a keyword that
            loads weights another way (``device_map``, ``state_dict``, ...) inside a
            worker's build.
    """
    _check_quantization(kwargs)
    mode = build_mode()
    transformers = require("transformers", "polytrain.hf.from_pretrained")
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    if mode is None:
        return cls.from_pretrained(os.fspath(path), **kwargs)
    weights = SafetensorsDir(path)  # fails early on a directory without weights
    model = _structure(cls, path, kwargs, mode, weights)
    source = WeightsSource(weights, getattr(model, "base_model_prefix", "") or "")
    _check_complete(model, source)
    setattr(model, SOURCE_ATTR, source)
    return model


class Pretrained:
    """A ``model_creator`` that loads an HF checkpoint directory: ``config -> from_pretrained(path)``.

    ``TorchTrainer(model_creator=polytrain.hf.pretrained("ckpt/gpt2"), ...)``: see
    :func:`from_pretrained` (each rank reads only what it keeps).

    Args:
        path: the checkpoint directory.
        model_class: the HF class (default: ``AutoModelForCausalLM``).
        **kwargs: ``from_pretrained``'s keywords.
    """

    def __init__(self, path: str | os.PathLike, model_class: Any = None, **kwargs: Any) -> None:
        self.path = os.fspath(path)
        self.model_class = model_class
        self.kwargs = kwargs

    def __call__(self, config: dict[str, Any]) -> torch.nn.Module:
        return from_pretrained(self.path, self.model_class, **self.kwargs)

    def __repr__(self) -> str:
        return f"pretrained({self.path!r})"


def pretrained(path: str | os.PathLike, model_class: Any = None, **kwargs: Any) -> Pretrained:
    """A ``model_creator`` that loads ``path`` (see :class:`Pretrained` and :func:`from_pretrained`)."""
    return Pretrained(path, model_class, **kwargs)


# ------------------------------------------------------------------ checks
def _check_quantization(kwargs: dict[str, Any]) -> None:
    asked = [key for key in _QUANTIZED if kwargs.get(key)]
    if asked and not torch.cuda.is_available():
        raise ConfigError(
            f"A 4/8-bit quantized base ({', '.join(f'{k}=...' for k in asked)}; QLoRA) needs a "
            f"CUDA GPU: bitsandbytes' quantized kernels run on CUDA only, and this worker has "
            f"none. Train on GPU workers (use_gpu=True), or load the base unquantized "
            f"(dtype=torch.bfloat16 or float32) for LoRA on CPU."
        )
    if asked and build_mode() is not None:
        raise ConfigError(
            f"polytrain.hf.from_pretrained reads unquantized weights straight into each rank's "
            f"shard; {asked[0]} is not supported there. Call transformers' from_pretrained(..., "
            f"{asked[0]}=...) in model_creator instead (backend='ddp')."
        )


def _check_complete(model: torch.nn.Module, source: WeightsSource) -> None:
    """Every parameter must come from the files (tied ones through a name the files hold)."""
    found = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if source.key_for(n)}
    missing = [n for n, p in model.named_parameters() if id(p) not in found]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"{source.path!r} lacks {len(missing)} parameter(s) of {type(model).__name__}: "
            f"{shown}. from_pretrained would initialise them at random; polytrain.hf reads "
            f"every weight from the files. Load a checkpoint of this architecture, or call "
            f"transformers' from_pretrained in model_creator (rank 0 then reads the whole model)."
        )


# --------------------------------------------------------------- structure
def _structure(
    cls: Any, path: str | os.PathLike, kwargs: dict[str, Any], mode: str, weights: Any = None
) -> torch.nn.Module:
    """``cls``'s model for ``path`` built as ``mode`` says, without reading its weights."""
    for key in _REFUSED:
        if kwargs.get(key):
            raise ConfigError(
                f"from_pretrained({key}=...) loads the weights another way; a worker's build "
                f"reads them into each rank's shard itself. Drop {key}, or set "
                f'backend_config={{"init_on_rank0": False}} to load the full model on every rank.'
            )
    if (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path"):
        raise ConfigError(
            f"{os.fspath(path)!r} holds a PEFT adapter, not a model: build the base with "
            f"from_pretrained(base_path) in model_creator, then load the adapter with "
            f"peft.PeftModel.from_pretrained(model, {os.fspath(path)!r}, is_trainable=True)."
        )
    transformers = require("transformers", "polytrain.hf.from_pretrained")
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    attn = kwargs.pop("attn_implementation", None)
    config = kwargs.pop("config", None)
    hub = {key: kwargs.pop(key) for key in _HUB if key in kwargs}
    for key in (*_IGNORED, *_REFUSED):
        kwargs.pop(key, None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config, kwargs = transformers.AutoConfig.from_pretrained(
            os.fspath(config or path), return_unused_kwargs=True, **hub, **kwargs
        )
    else:
        config = copy.deepcopy(config)  # as from_pretrained: the caller's config stays as it is
    dtype = _resolve_dtype(dtype, config, weights)
    config.name_or_path = os.fspath(path)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if hasattr(cls, "_model_mapping"):  # an Auto class resolves the architecture from the config
        build = cls.from_config
        if "trust_remote_code" in hub:
            kwargs["trust_remote_code"] = hub["trust_remote_code"]
    else:
        build = cls._from_config
    if mode == "empty":
        with _params_on_meta():
            model = build(config, dtype=dtype, **kwargs)
        _allocate_on_cpu(model)
    else:
        model = build(config, dtype=dtype, **kwargs)
    model.eval()  # as from_pretrained returns it
    _load_generation_config(model, path)
    return model


def _resolve_dtype(dtype: Any, config: Any, weights: Any) -> torch.dtype:
    """``from_pretrained``'s dtype: ``"auto"`` is the config's, else the files' floating dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return getattr(torch, str(dtype))
    found = getattr(config, "dtype", None)
    if found is not None:
        return found if isinstance(found, torch.dtype) else getattr(torch, str(found))
    for key in weights.keys() if weights is not None else []:
        name = weights.dtype(key)
        if name in ("float32", "float16", "bfloat16", "float64"):
            return getattr(torch, name)
    return torch.get_default_dtype()


def _load_generation_config(model: torch.nn.Module, path: str | os.PathLike) -> None:
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        return
    if (Path(os.fspath(path)) / "generation_config.json").is_file():
        transformers = require("transformers", "polytrain.hf.from_pretrained")
        model.generation_config = transformers.GenerationConfig.from_pretrained(os.fspath(path))


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters registered within land on the meta device; buffers are computed as usual.

    (Accelerate's ``init_empty_weights(include_buffers=False)``.) Non-persistent
    buffers such as rotary tables are in no file: they must have their values.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _allocate_on_cpu(model: torch.nn.Module) -> None:
    """Storage on the CPU for every meta parameter, ties kept; no values (untouched pages)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                empty = torch.empty_like(param, device="cpu")
                made[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]


# ------------------------------------------------- transformers' from_pretrained
def _structure_only_from_pretrained(cls: Any, path: Any, *model_args: Any, **kwargs: Any) -> Any:
    """``PreTrainedModel.from_pretrained`` inside a discarded build: the structure, nothing read."""
    if model_args:
        raise ConfigError(
            "from_pretrained with positional model arguments cannot run on a rank that builds "
            "only the model's structure; pass them as keywords or set backend_config={\"init_"
            'on_rank0": False}.'
        )
    if kwargs.get("state_dict") is not None and path is None:
        kwargs.pop("state_dict")
    return _structure(cls, path, kwargs, build_mode() or "meta")


def _patch_from_pretrained(modeling_utils: Any) -> Any:
    """Replace ``PreTrainedModel.from_pretrained``; returns the original (a classmethod)."""
    model_cls = modeling_utils.PreTrainedModel
    original = model_cls.__dict__["from_pretrained"]
    model_cls.from_pretrained = classmethod(_structure_only_from_pretrained)
    return original


@contextlib.contextmanager
def structure_only() -> Iterator[None]:
    """Within, ``transformers``' ``from_pretrained`` builds the structure only (no file read).

    ``transformers`` is patched when it is imported already, or as soon as the creator
    imports it (importing it here would cost seconds on every build of a non-HF model).
    """
    done: dict[str, Any] = {}

    def patch(module: Any) -> None:
        done["module"], done["original"] = module, _patch_from_pretrained(module)

    name = "transformers.modeling_utils"
    hook = None
    if name in sys.modules:
        patch(sys.modules[name])
    elif importlib.util.find_spec("transformers") is not None:
        hook = _AfterImport(name, patch)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None:
            sys.meta_path.remove(hook)
        if "module" in done:
            done["module"].PreTrainedModel.from_pretrained = done["original"]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``action(module)`` right after module ``name`` is first imported."""

    def __init__(self, name: str, action: Any) -> None:
        self.name, self.action, self.busy = name, action, False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenAct(spec.loader, self.action)
        return spec


class _ThenAct(importlib.abc.Loader):
    def __init__(self, loader: Any, action: Any) -> None:
        self.loader, self.action = loader, action

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.action(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
