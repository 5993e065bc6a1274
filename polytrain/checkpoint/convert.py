"""Offline conversion between a checkpoint directory and a consolidated checkpoint file (no Ray).

``polytrain checkpoint convert`` calls these. A directory written by the
workers (sharded or not, any backend and world size) becomes the single file
``trainer.save()`` writes, and back: a consolidated file becomes a directory of
``num_shards`` rank files that any trainer reads at any world size.
"""

from __future__ import annotations

import os
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import (
    DirReader,
    SaveRequest,
    meta_bytes,
    plan_pieces,
    snapshot,
    write_part,
)
from polytrain.checkpoint.pieces import assemble, nbytes, split_state
from polytrain.checkpoint.storage import Storage
from polytrain.errors import CheckpointError


def read_directory(path: str | os.PathLike) -> dict[str, Any]:
    """The consolidated checkpoint dict of a checkpoint directory (every tensor read whole).

    Raises:
        CheckpointError: the directory is not a committed, readable checkpoint.
    """
    checkpoint = layout.open_checkpoint(os.fspath(path))
    with DirReader(checkpoint) as reader:
        tensors = assemble(reader.skeleton, reader, reader.paths())
    return {**checkpoint.meta, **tensors}


def to_consolidated(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Write checkpoint directory ``src`` as one consolidated file ``dst`` (atomically); returns its path."""
    return str(ckpt.save_checkpoint(read_directory(src), dst))


def write_directory(state: dict[str, Any], dst: str | os.PathLike, num_shards: int = 1) -> str:
    """Write a consolidated checkpoint dict as a checkpoint directory of ``num_shards`` rank files.

    Raises:
        CheckpointError: ``dst`` exists and is not empty, or ``state`` is not a checkpoint dict.
    """
    ckpt.validate_checkpoint(state, "state")
    if num_shards < 1:
        raise CheckpointError(f"num_shards must be >= 1; got {num_shards}.")
    storage = Storage(dst)
    if storage.exists() and storage.listdir():
        raise CheckpointError(
            f"{storage.url!r} exists and is not empty; give a new directory to convert into."
        )
    local = split_state(state, replicated=True)
    meta = {
        **{k: v for k, v in state.items() if k not in ("models", "optimizers")},
        **local.skeleton,
    }
    header = {
        "framework": state["framework"],
        "backend": state.get("backend"),
        "world_size": state.get("world_size"),
        "epoch": state["epoch"],
        "global_step": state.get("global_step", 0),
        "converted_from": "consolidated",
    }
    request = SaveRequest(url=storage.url, header=header)
    for rank in reversed(range(num_shards)):  # rank 0 last: it commits
        mine = snapshot(plan_pieces(local.pieces, rank, num_shards), copy=False)
        write_part(request, rank, num_shards, mine, meta_bytes(meta) if rank == 0 else None)
    return storage.url


def to_sharded(src: str | os.PathLike, dst: str | os.PathLike, num_shards: int = 1) -> str:
    """Write consolidated checkpoint file ``src`` as checkpoint directory ``dst``; returns its path."""
    return write_directory(ckpt.load_checkpoint(src), dst, num_shards)


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """A summary of a checkpoint file or directory: format, framework, backend, epoch, tensors, bytes."""
    if layout.is_checkpoint_dir(path):
        checkpoint = layout.open_checkpoint(os.fspath(path))
        manifest = checkpoint.manifest
        return {
            "path": checkpoint.url,
            "layout": "directory",
            **{
                k: manifest.get(k)
                for k in ("framework", "backend", "world_size", "epoch", "global_step")
            },
            "writers": manifest.get("writers"),
            "tensors": len(manifest["tensors"]),
            "bytes": sum(int(f.get("bytes") or 0) for f in manifest["files"].values()),
        }
    state = ckpt.load_checkpoint(path)
    tensors = split_state(state, replicated=True).pieces
    return {
        "path": os.path.abspath(os.fspath(path)),
        "layout": "consolidated file",
        **{k: state.get(k) for k in ("framework", "backend", "world_size", "epoch", "global_step")},
        "tensors": len(tensors),
        "bytes": sum(nbytes(p.tensor) for p in tensors),
    }
