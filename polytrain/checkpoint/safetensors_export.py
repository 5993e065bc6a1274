"""Weights users can take away: a checkpoint's model as safetensors in the Hugging Face layout.

A committed checkpoint directory (or a consolidated checkpoint file) holds the
model's tensors under their ``state_dict`` keys. :func:`write_pretrained` writes
them the way ``transformers``' ``save_pretrained`` does::

    <dst>/config.json  generation_config.json     # when the model has an HF config
          model.safetensors                       # or, above max_shard_size:
          model-00001-of-00003.safetensors ...    #   shards, filled in state_dict order,
          model.safetensors.index.json            #   and HF's index ({"metadata", "weight_map"})

Tensors are read from the checkpoint one shard file at a time, so the writer
holds at most about one shard in memory. Shared (tied) tensors are written once:
which name is dropped was decided from the live model when the checkpoint was
written (the :data:`META_KEY` entry of its meta; see
``polytrain.trainer_api.torch.model_info``): HF's ``_tied_weights_keys`` for a
``transformers`` model (GPT-2 keeps ``transformer.wte.weight`` and drops
``lm_head.weight``), ``safetensors.torch.save_model``'s rule otherwise. The
export is written into a temporary sibling directory and renamed at the end: a
partial export never looks complete.

Needs ``safetensors`` (and ``huggingface_hub`` for the shard plan), the ``hf``
extra; nothing here imports them at module level.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import DirReader
from polytrain.checkpoint.storage import fsync_path
from polytrain.compat.imports import require
from polytrain.errors import CheckpointError, ConfigError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: The checkpoint meta entry (a list, one per model) with what an export needs.
META_KEY = "export_info"

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B)$", re.IGNORECASE)
_UNITS = {
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}  # fmt: skip


# ------------------------------------------------------------------ checks
def check_target(path: str | os.PathLike) -> Path:
    """The export directory as an absolute local path, checked before anything is written.

    Raises:
        ConfigError: ``path`` is a URL (write locally, then upload the directory).
        CheckpointError: ``path`` is a file, or a directory that is not empty.
    """
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(
            f"Export path {text!r} is a URL; the Hugging Face layout is written to a local "
            f"(or NFS) directory. Export there, then upload it (e.g. huggingface-cli upload)."
        )
    target = Path(text.removeprefix("file://")).expanduser().resolve()
    if target.is_file():
        raise CheckpointError(
            f"Export path {str(target)!r} is a file; give a new (or empty) directory to write "
            f"the model into."
        )
    if target.is_dir() and any(target.iterdir()):
        raise CheckpointError(
            f"Export path {str(target)!r} exists and is not empty; nothing was written. Give a "
            f"new (or empty) directory, or delete {str(target)!r} first."
        )
    return target


def parse_max_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"`` / ``"200MB"`` / ``"1GiB"``.

    The units are HF's: ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``... of 1024.

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.match(value.strip()) if isinstance(value, str) else None
    if match is not None and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise ConfigError(
        f"max_shard_size={value!r} is not a size; give a positive number of bytes or a string "
        f'such as "5GB", "500MB" or "100KB" (1GB = 10**9 bytes; "1GiB" = 2**30).'
    )


# ------------------------------------------------------------------ sources
class ModelTensors:
    """One model's tensors in a checkpoint, by ``state_dict`` key: shapes, dtypes, reads.

    Args:
        names: the keys, in ``state_dict`` order.
        shape_dtype: ``key -> (shape, dtype name)``.
        read: ``key -> tensor`` (read whole, on the CPU, in its shape).
    """

    def __init__(
        self,
        names: list[str],
        shape_dtype: dict[str, tuple[tuple[int, ...], str]],
        read: Callable[[str], Any],
    ) -> None:
        self.names = names
        self.shape_dtype = shape_dtype
        self.read = read

    def nbytes(self, name: str) -> int:
        """The bytes of tensor ``name``."""
        shape, dtype = self.shape_dtype[name]
        total = _ITEMSIZE[dtype]
        for dim in shape:
            total *= int(dim)
        return total

    @classmethod
    def from_reader(cls, reader: DirReader, index: int, order: list[str]) -> ModelTensors:
        """Model ``index`` of a checkpoint directory; ``order``: the keys' ``state_dict`` order."""
        found = {}
        for info in reader.tensors.values():
            path = tuple(info["path"])
            if path[:2] == ("models", index) and len(path) == 3:
                found[str(path[2])] = (tuple(info["shape"]), info["dtype"])
        names = [n for n in order if n in found] + [n for n in found if n not in set(order)]

        def read(name: str) -> Any:
            path = ("models", index, name)
            return reader.read(path).reshape(reader.shape(path))

        return cls(names, found, read)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ModelTensors:
        """A model ``state_dict`` held in memory (a consolidated checkpoint's)."""
        tensors = {k: v for k, v in state.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
        shapes = {
            k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()
        }
        # A copy: torch.load keeps tied tensors shared, and safetensors refuses shared memory.
        return cls(list(tensors), shapes, lambda name: tensors[name].detach().cpu().clone())


# ------------------------------------------------------------------ writing
def write_pretrained(
    tensors: ModelTensors,
    info: dict[str, Any] | None,
    dst: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Write a model in the HF layout into ``dst`` (new or empty), atomically.

    Args:
        tensors: the model's tensors (from a checkpoint directory or a consolidated state).
        info: the checkpoint's export info for this model (``drop``: tied names to leave
            out, ``buffers``, ``files``: ``config.json`` / ``generation_config.json``
            as HF writes them); None for a checkpoint written without it (every tensor
            is written, no ``config.json``).
        dst: the export directory.
        max_shard_size: bytes per safetensors file (int or ``"5GB"``); HF's default 5GB.

    Returns:
        ``{"path", "files", "sharded", "total_size"}``.
    """
    target = check_target(dst)
    limit = parse_max_shard_size(max_shard_size)
    info = info or {}
    present = set(tensors.names)
    # A duplicate goes only when the name kept for it is there to be written.
    drop = {name: kept for name, kept in (info.get("drop") or {}).items() if kept in present}
    names = [n for n in tensors.names if n not in drop]
    split = _plan(tensors, names, limit)
    with staged(target) as tmp:
        files = _write_shards(tensors, split, tmp, drop, hf=bool(info.get("files")))
        if split.is_sharded:
            index = _index(tensors, names, set(info.get("buffers") or []), split)
            write_text(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(INDEX_NAME)
        for name, text in (info.get("files") or {}).items():
            write_text(tmp / name, _with_dtype(name, text, tensors, names))
            files.append(name)
    return {
        "path": str(target),
        "files": sorted(files),
        "sharded": split.is_sharded,
        "total_size": split.metadata["total_size"],
    }


def _plan(tensors: ModelTensors, names: list[str], limit: int) -> Any:
    """HF's shard plan (``huggingface_hub``): greedy, in ``state_dict`` order."""
    hub = require("huggingface_hub", "Writing safetensors shards")
    return hub.split_state_dict_into_shards_factory(
        {name: (name,) for name in names},  # not the name itself: the planner skips str values
        get_storage_size=lambda entry: tensors.nbytes(entry[0]),
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=limit,
    )


def _write_shards(
    tensors: ModelTensors, split: Any, tmp: Path, drop: dict[str, str], hf: bool
) -> list[str]:
    """Each shard file: its tensors read, written, released before the next (one shard in memory)."""
    storage = require("safetensors.torch", "Writing safetensors files")
    metadata = {"format": "pt"}
    if not hf:  # as safetensors.torch.save_model records the names it dropped
        metadata.update({name: kept for name, kept in drop.items()})
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors.read(name).contiguous() for name in names}
        storage.save_file(shard, str(tmp / filename), metadata=metadata)
        del shard
        fsync_path(tmp / filename)
    return list(split.filename_to_tensors)


def _index(tensors: ModelTensors, names: list[str], buffers: set[str], split: Any) -> dict:
    """HF's ``model.safetensors.index.json``: parameter count, bytes, and which file holds what."""
    parameters = sum(_numel(tensors, name) for name in names if name not in buffers)
    return {
        "metadata": {"total_parameters": parameters, **split.metadata},
        "weight_map": split.tensor_to_filename,
    }


def _numel(tensors: ModelTensors, name: str) -> int:
    total = 1
    for dim in tensors.shape_dtype[name][0]:
        total *= int(dim)
    return total


def _with_dtype(name: str, text: str, tensors: ModelTensors, names: list[str]) -> str:
    """``config.json`` with ``dtype`` set to the weights' as written (HF: the model's dtype).

    The checkpoint holds what the backend keeps (ZeRO: fp32 master weights), which may
    differ from the dtype of the module that described itself.
    """
    if name != "config.json":
        return text
    floating = [tensors.shape_dtype[n][1] for n in names]
    floating = [d for d in floating if d in ("float64", "float32", "float16", "bfloat16")]
    config = json.loads(text)
    if not floating or config.get("dtype", floating[0]) == floating[0]:
        return text
    config["dtype"] = floating[0]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A temporary sibling of ``target`` to write into; renamed to ``target`` at the end.

    A partial export never looks complete: on an error the temporary directory goes.
    """
    tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to disk."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished temporary directory to ``target`` (an empty ``target`` is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        target.rmdir()  # only an empty one: check_target refused anything else
    try:
        os.rename(tmp, target)
    except OSError as exc:
        raise CheckpointError(
            f"Could not move the finished export to {str(target)!r} ({exc}): something else "
            f"wrote there meanwhile. Delete it or choose another path; the export is in "
            f"{str(tmp)!r}."
        ) from exc
    fsync_path(target.parent)


# ------------------------------------------------------------------ offline
def export_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    model_index: int = 0,
) -> dict[str, Any]:
    """Write model ``model_index`` of a checkpoint (directory or consolidated file) in the HF layout.

    ``config.json`` is written when the checkpoint carries the model's HF config
    (checkpoints written by this polytrain do, for ``transformers`` models).

    Raises:
        CheckpointError: ``src`` is not a readable torch checkpoint, has no model
            ``model_index``, holds a PEFT model (its exports are the adapter or the merged
            model), or ``dst`` exists and is not empty.
    """
    check_target(dst)
    parse_max_shard_size(max_shard_size)
    with checkpoint_model(src, model_index) as (tensors, info):
        if (info or {}).get("peft"):
            raise CheckpointError(
                f"Checkpoint {os.fspath(src)!r} holds a PEFT model, which is no Hugging Face "
                f"model as it stands: write its adapter (--to peft) or the model merged into "
                f"its base (--to safetensors --merge)."
            )
        return write_pretrained(tensors, info, dst, max_shard_size)


@contextlib.contextmanager
def checkpoint_model(
    src: str | os.PathLike, model_index: int = 0
) -> Iterator[tuple[ModelTensors, dict[str, Any] | None]]:
    """Model ``model_index`` of a checkpoint directory or file: its tensors and its export info.

    A directory's tensors are read from its files while the context is open.

    Raises:
        CheckpointError: ``src`` is not a readable torch checkpoint, has no model
            ``model_index``, or no tensors of it.
    """
    if layout.is_checkpoint_dir(src):
        checkpoint = layout.open_checkpoint(os.fspath(src), framework="torch")
        info = _model_info(checkpoint.meta, model_index, checkpoint.url)
        with DirReader(checkpoint) as reader:
            tensors = ModelTensors.from_reader(reader, model_index, (info or {}).get("keys") or [])
            _require_tensors(tensors, model_index, checkpoint.url)
            yield tensors, info
        return
    state = ckpt.load_checkpoint(src, framework="torch")
    info = _model_info(state, model_index, os.fspath(src))
    yield ModelTensors.from_state(state["models"][model_index]), info


def _model_info(meta: dict[str, Any], index: int, source: str) -> dict[str, Any] | None:
    models = meta.get("models") or []
    if index < 0 or index >= max(1, len(models)):
        raise CheckpointError(
            f"Checkpoint {source!r} holds {len(models)} model(s); model_index={index} is out of "
            f"range (use 0..{len(models) - 1})."
        )
    infos = meta.get(META_KEY) or []
    return infos[index] if index < len(infos) else None


def _require_tensors(tensors: ModelTensors, index: int, source: str) -> None:
    if not tensors.names:
        raise CheckpointError(
            f"Checkpoint {source!r} has no tensors of model {index}; nothing to export."
        )
