"""An HF checkpoint directory's safetensors weights, read range by range (no full copy).

``transformers``' ``save_pretrained`` writes ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` (its
``weight_map`` says which file holds which tensor). :class:`SafetensorsDir` opens
either form and reads any contiguous range of a tensor's flattened elements: a
rank reads exactly its shard's range, never the whole tensor it does not keep. A
range is read with one positioned read straight into the tensor returned (the
safetensors header gives its byte offset): no file page is mapped into the process,
so a rank's resident memory grows by what it keeps, not by the file pages it read
through. Nothing is read before it is asked for.

:class:`WeightsSource` maps the parameter names of a model built from such a
directory to the directory's keys: a model wrapped afterwards by ``peft``
(``c_attn.base_layer.weight``) or renamed by a wrapper module still finds its
tensors.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from polytrain.compat.imports import require
from polytrain.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: The attribute that marks a module whose weights are still to be read from files.
SOURCE_ATTR = "_polytrain_weights_source"

_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
#: Name segments that wrappers insert between a module and its own parameters.
_WRAPPER_SEGMENTS = (
    "base_layer",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_orig_mod",
)


class SafetensorsDir:
    """The safetensors weights of an HF checkpoint directory (sharded or not).

    Args:
        path: the directory ``save_pretrained`` wrote.

    Raises:
        CheckpointError: ``path`` is not a directory, or holds no safetensors weights
            (the message lists what it holds).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(os.fspath(path)).expanduser()
        self.files = _weight_map(self.path)
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}

    def keys(self) -> list[str]:
        """Every tensor name, in the files' order."""
        return list(self.files)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def _slice(self, key: str) -> Any:
        if key not in self.files:
            raise CheckpointError(f"{str(self.path)!r} has no tensor {key!r}.")
        name = self.files[key]
        if name not in self._handles:
            safetensors = require("safetensors", "Reading pretrained safetensors weights")
            self._handles[name] = safetensors.safe_open(str(self.path / name), "pt")
        return self._handles[name].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        """The full shape of tensor ``key``."""
        return tuple(int(d) for d in self._slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The dtype of tensor ``key`` as torch names it (``"float32"``, ``"bfloat16"``...)."""
        found = self._slice(key).get_dtype()
        return _DTYPES.get(found, found.lower())

    def read(self, key: str, start: int = 0, numel: int | None = None) -> Any:
        """Flattened elements ``[start, start + numel)`` (default: all) of tensor ``key``, 1-D.

        Only the range's bytes are read from the file, into the tensor returned.

        Raises:
            CheckpointError: no such tensor, or a range outside it.
        """
        shape = self.shape(key)
        total = math.prod(shape)
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(
                f"Range [{start}, {start + numel}) is outside tensor {key!r} ({total} elements) "
                f"in {str(self.path)!r}."
            )
        return self._read_range(key, start, numel)

    def _read_range(self, key: str, start: int, numel: int) -> Any:
        """Elements ``[start, start + numel)`` of ``key``, read with ``readinto`` (no mmap)."""
        import torch

        dtype = getattr(torch, self.dtype(key))
        out = torch.empty(numel, dtype=dtype)
        if numel == 0:
            return out
        name = self.files[key]
        data_start, begin = self._offsets(name, key)
        raw = out.view(torch.uint8).numpy()  # the tensor's own bytes
        with open(self.path / name, "rb") as file:
            file.seek(data_start + begin + start * out.element_size())
            if file.readinto(memoryview(raw)) != raw.nbytes:
                raise CheckpointError(
                    f"{str(self.path / name)!r} ended inside tensor {key!r}: the file is "
                    f"truncated; write the checkpoint again."
                )
        return out

    def _offsets(self, name: str, key: str) -> tuple[int, int]:
        """(where the data section of file ``name`` starts, where ``key`` starts in it)."""
        headers = self._headers.get(name)
        if headers is None:
            with open(self.path / name, "rb") as file:
                size = int.from_bytes(file.read(8), "little")
                headers = (8 + size, json.loads(file.read(size)))
            self._headers[name] = headers
        data_start, header = headers
        return data_start, int(header[key]["data_offsets"][0])

    def close(self) -> None:
        """Release the open files (the shapes' and dtypes' handles) and the parsed headers."""
        self._handles.clear()
        self._headers.clear()


def _weight_map(path: Path) -> dict[str, str]:
    """``tensor name -> file name`` of the directory's safetensors weights."""
    if not path.is_dir():
        raise CheckpointError(
            f"Pretrained weights directory {str(path)!r} does not exist or is not a directory; "
            f"give the directory that save_pretrained wrote (config.json and model.safetensors)."
        )
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(
                f"{str(index)!r} names shard file(s) {missing} that are not in the directory; "
                f"the checkpoint is incomplete. Copy the missing files."
            )
        return dict(weight_map)
    single = path / WEIGHTS_NAME
    if single.is_file():
        safetensors = require("safetensors", "Reading pretrained safetensors weights")
        with safetensors.safe_open(str(single), "pt") as handle:
            return dict.fromkeys(handle.keys(), WEIGHTS_NAME)
    present = sorted(p.name for p in path.iterdir())
    hint = (
        " It holds PyTorch .bin weights: load them once with from_pretrained and save them "
        "again with save_pretrained (transformers writes safetensors)."
        if any(name.endswith(".bin") for name in present)
        else ""
    )
    raise CheckpointError(
        f"{str(path)!r} holds no safetensors weights (neither {WEIGHTS_NAME} nor "
        f"{INDEX_NAME}); it holds {present or 'nothing'}.{hint}"
    )


class WeightsSource:
    """Where the parameters of one module built from a checkpoint directory come from.

    Attached (under :data:`SOURCE_ATTR`) to the module that ``polytrain.hf.from_pretrained``
    built without its weights; the backends read each rank's part of every parameter it
    finds here after the model is sharded.

    Args:
        weights: the directory's tensors.
        prefix: the module's ``base_model_prefix`` (HF checkpoints of a head model may
            leave it out, or a base model's may carry it).
    """

    def __init__(self, weights: SafetensorsDir, prefix: str = "") -> None:
        self.weights = weights
        self.prefix = prefix

    @property
    def path(self) -> str:
        """The checkpoint directory."""
        return str(self.weights.path)

    def key_for(self, name: str) -> str | None:
        """The directory's key of the module's parameter ``name`` (None: not in the files).

        Wrapper segments (``peft``'s ``base_layer``, FSDP's and activation checkpointing's
        wrapped modules) are dropped; the ``base_model_prefix`` is tried with and without.
        """
        parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
        key = ".".join(parts)
        candidates = [key]
        if self.prefix:
            head = f"{self.prefix}."
            candidates.append(key.removeprefix(head) if key.startswith(head) else head + key)
        return next((c for c in candidates if c in self.weights), None)

    def __reduce__(self) -> tuple:
        # Ray pickles models (a local-mode trainer, get_model): only the path travels.
        return (_source_from_path, (self.path, self.prefix))


def _source_from_path(path: str, prefix: str) -> WeightsSource:
    return WeightsSource(SafetensorsDir(path), prefix)


def file_backed(model: Any) -> dict[str, tuple[WeightsSource, str]]:
    """``parameter name -> (source, key)`` for every parameter of ``model`` still to be read from files.

    Names are ``model.named_parameters()``'s (every name of a shared parameter); a
    parameter counts once it has one name the files hold (tied weights: the files keep
    one of the names).
    """
    found: dict[str, tuple[WeightsSource, str]] = {}
    keys_by_param: dict[int, tuple[WeightsSource, str]] = {}
    for module in model.modules():
        source = vars(module).get(SOURCE_ATTR)  # not getattr: FSDP1 forwards it to its module
        if source is None:
            continue
        for name, param in module.named_parameters(remove_duplicate=False):
            key = source.key_for(name)
            if key is not None:
                keys_by_param.setdefault(id(param), (source, key))
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in keys_by_param:
            found[name] = keys_by_param[id(param)]
    return found


def forget_sources(model: Any) -> None:
    """Drop the marks of :func:`file_backed` once the weights are read."""
    for module in model.modules():
        vars(module).pop(SOURCE_ATTR, None)
