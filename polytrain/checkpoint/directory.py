"""Writing and reading checkpoint directories: raw tensor ranges, the commit, range reads.

Each rank writes the :class:`~polytrain.checkpoint.pieces.Piece` ranges it
holds into ``rank_00001.bin`` (rank 1's) and an index of them into ``rank_00001.json``;
replicated tensors (held whole by every rank) are spread over the ranks so
that each writes about the same number of bytes, as torch.distributed.checkpoint's
planner does. Rank 0 also writes ``meta.pt`` and, once every rank's index is
there, merges them into ``manifest.json``, checks that every tensor is covered
exactly once, and writes the ``COMMITTED`` marker last. No collective is used:
the ranks meet through the storage, so the same protocol serves a background
(asynchronous) save and every backend.

:class:`DirReader` reads any range of any tensor, touching only the bytes of the
pieces that overlap it (``seek`` + ``readinto``, also on remote filesystems).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field
from typing import IO, Any

from polytrain.checkpoint.layout import (
    MANIFEST,
    MARKER,
    META,
    META_JSON,
    CheckpointDir,
    build_manifest,
    dtype_name,
    rank_file,
    tensor_key,
)
from polytrain.checkpoint.pieces import FROZEN_KEY, Piece, StatePath, nbytes
from polytrain.checkpoint.storage import Storage
from polytrain.errors import CheckpointError


@dataclass
class SaveRequest:
    """Driver -> workers: write a checkpoint directory.

    Attributes:
        url: the checkpoint directory (local path or fsspec URL); empty or absent.
        header: what the manifest records: framework, backend, world_size, epoch, global_step.
        asynchronous: snapshot to host memory and write in a background thread.
        commit_timeout_s: how long rank 0 waits for the other ranks' files before giving up.
        writers: ranks that write (None: every rank of the group).
    """

    url: str
    header: dict[str, Any]
    asynchronous: bool = False
    commit_timeout_s: float = 1800.0
    writers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- planning
def plan_pieces(pieces: list[Piece], rank: int, world_size: int) -> list[Piece]:
    """The pieces this rank writes: its own ranges, and its share of the replicated tensors.

    Every rank computes the same assignment from the same replicated tensors
    (largest first, each to the rank with the fewest bytes so far), so each
    replicated tensor is written exactly once without any communication.
    """
    mine = [p for p in pieces if not p.replicated]
    replicated = sorted(
        (p for p in pieces if p.replicated),
        key=lambda p: (-nbytes(p.tensor), tensor_key(p.path)),
    )
    loads = [0] * max(1, world_size)
    for piece in replicated:
        owner = min(range(len(loads)), key=lambda r: (loads[r], r))
        loads[owner] += nbytes(piece.tensor)
        if owner == rank:
            mine.append(piece)
    return mine


def snapshot(
    pieces: list[Piece], copy: bool, staging: dict[tuple, Any] | None = None
) -> list[Piece]:
    """The pieces with their tensors detached, contiguous and in host memory (copied if ``copy``).

    Args:
        pieces: what to write.
        copy: copy every tensor (an asynchronous save: training goes on changing them).
        staging: host buffers kept between saves, reused when a piece has the same
            place, size and dtype as last time (no allocation, no page faults: the copy
            is a plain memcpy). Filled in here; pinned for CUDA tensors.
        Numpy arrays (TensorFlow's weights, fresh copies already) pass through.
    """
    import numpy as np

    if all(isinstance(p.tensor, np.ndarray) for p in pieces):
        return list(pieces)
    import torch

    result = []
    for piece in pieces:
        if not isinstance(piece.tensor, torch.Tensor):
            result.append(piece)
            continue
        tensor = piece.tensor.detach()
        if copy or tensor.device.type != "cpu":
            key = (tensor_key(piece.path), piece.start, tensor.numel(), tensor.dtype)
            buffer = staging.get(key) if staging is not None else None
            if buffer is None:
                pin = tensor.device.type == "cuda"
                buffer = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=pin)
                if staging is not None:
                    staging[key] = buffer
            buffer.copy_(tensor.reshape(-1), non_blocking=buffer.is_pinned())
            tensor = buffer
        result.append(
            Piece(piece.path, piece.shape, tensor.contiguous(), piece.start, piece.replicated)
        )
    if any(isinstance(p.tensor, torch.Tensor) and p.tensor.is_pinned() for p in result):
        torch.cuda.synchronize()
    return result


# ----------------------------------------------------------------- writing
def write_part(
    request: SaveRequest,
    rank: int,
    world_size: int,
    pieces: list[Piece],
    meta: tuple[str, bytes] | None,
    rng: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write this rank's part of a checkpoint directory; rank 0 then commits it.

    Args:
        request: where and what.
        rank: this worker's rank among the writers.
        world_size: the number of writers.
        pieces: the (snapshotted) pieces this rank writes, from :func:`plan_pieces`.
        meta: rank 0: ``(file name, content)`` of the consolidated envelope without
            tensors (:func:`meta_bytes`: ``meta.pt``; :func:`meta_json`: ``meta.json``).
        rng: this rank's random generator states (:mod:`polytrain.checkpoint.rng_state`),
            kept in its index.

    Returns:
        This rank's index (``rank_00001.json`` for rank 1): file, bytes and entries.
    """
    storage = Storage(request.url)
    index: dict[str, Any] = {"rank": rank, "file": None, "bytes": 0, "entries": []}
    if rng is not None:
        index["rng"] = rng
    if pieces:
        index["file"] = rank_file(rank, "bin")
        with storage.open_write(index["file"]) as handle:
            index["entries"], index["bytes"] = _write_tensors(handle, pieces)
    if meta is not None:
        storage.write_bytes(meta[0], meta[1])
        index["meta_file"], index["meta_bytes"] = meta[0], len(meta[1])
    storage.write_bytes(rank_file(rank, "json"), json.dumps(index).encode())
    if rank == 0:
        commit(storage, request.header, world_size, request.commit_timeout_s)
    return index


def failure_marker(rank: int) -> str:
    """``rank_00001.failed``: the empty file a rank whose write failed leaves for rank 0."""
    return rank_file(rank, "failed")


def meta_bytes(meta_state: dict[str, Any]) -> tuple[str, bytes]:
    """``meta.pt``: ``meta_state`` serialised now (``torch.save``), so later training cannot leak in."""
    import torch

    buffer = io.BytesIO()
    torch.save(meta_state, buffer)
    return META, buffer.getvalue()


def meta_json(meta_state: dict[str, Any]) -> tuple[str, bytes]:
    """``meta.json``: a ``meta_state`` of plain JSON types (TensorFlow's: no torch needed)."""
    return META_JSON, json.dumps(meta_state).encode()


def _raw(array: Any) -> Any:
    """The bytes of a contiguous torch tensor or numpy array, as a uint8 numpy view."""
    import numpy as np

    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    import torch

    return array.reshape(-1).view(torch.uint8).numpy()


def _write_tensors(handle: IO[bytes], pieces: list[Piece]) -> tuple[list[dict], int]:
    entries, offset = [], 0
    for piece in pieces:
        tensor = piece.tensor
        size = nbytes(tensor)
        if size:
            handle.write(memoryview(_raw(tensor)))
        entries.append(
            {
                "path": list(piece.path),
                "shape": list(piece.shape),
                "dtype": dtype_name(tensor.dtype),
                "start": piece.start,
                "numel": piece.numel,
                "offset": offset,
            }
        )
        offset += size
    return entries, offset


def commit(
    storage: Storage, header: dict[str, Any], world_size: int, timeout_s: float
) -> dict[str, Any]:
    """Rank 0: wait for every rank's index, write the manifest, then the commit marker.

    Raises:
        CheckpointError: a rank's index did not appear within ``timeout_s``, or the ranks'
            pieces do not cover every tensor exactly once (the checkpoint stays uncommitted).
    """
    names = [rank_file(r, "json") for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        missing = [n for n in names if not storage.exists(n)]
        if not missing:
            break
        failed = [r for r in range(world_size) if storage.exists(failure_marker(r))]
        if failed:
            raise CheckpointError(
                f"Checkpoint {storage.url!r} was not committed: rank(s) {failed} failed to "
                f"write their part (see their error)."
            )
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"Checkpoint {storage.url!r} was not committed: {missing[:4]} did not appear "
                f"within {timeout_s:.0f} s (a worker failed while writing)."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    indexes = [json.loads(storage.read_bytes(n)) for n in names]
    manifest = build_manifest(header, indexes, storage.url)
    storage.write_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())
    storage.write_bytes(MARKER, json.dumps({"committed_at": time.time()}).encode())
    return manifest


# ----------------------------------------------------------------- reading
class DirReader:
    """A :class:`~polytrain.checkpoint.pieces.ShardReader` over a committed checkpoint directory.

    Args:
        checkpoint: from :func:`~polytrain.checkpoint.layout.open_checkpoint`.
        numpy: return numpy arrays instead of torch tensors (TensorFlow workers never
            import torch).
    """

    def __init__(self, checkpoint: CheckpointDir, numpy: bool = False) -> None:
        self.checkpoint = checkpoint
        self.numpy = numpy
        self.storage = checkpoint.storage
        self.tensors: dict[str, dict[str, Any]] = checkpoint.manifest["tensors"]
        self._handles: dict[str, IO[bytes]] = {}
        meta = checkpoint.meta
        self._skeleton = {
            "models": meta.get("models") or [],
            "optimizers": meta.get("optimizers") or [],
            FROZEN_KEY: meta.get(FROZEN_KEY),
        }

    @property
    def skeleton(self) -> dict[str, Any]:
        """The consolidated ``{"models", "optimizers"}`` tree without tensors."""
        return self._skeleton

    def paths(self) -> list[StatePath]:
        """Every tensor path of the checkpoint."""
        return [tuple(info["path"]) for info in self.tensors.values()]

    def shape(self, path: StatePath) -> tuple[int, ...] | None:
        """The full shape of the tensor at ``path`` (None: not in the checkpoint)."""
        info = self.tensors.get(tensor_key(path))
        return None if info is None else tuple(info["shape"])

    def read(self, path: StatePath, start: int = 0, numel: int | None = None) -> Any:
        """Flattened elements ``[start, start + numel)`` of the tensor at ``path`` (1-D, CPU).

        A torch tensor, or a numpy array for a reader made with ``numpy=True``.

        Raises:
            CheckpointError: no such tensor, a range outside it, or a short read.
        """
        key = tensor_key(path)
        info = self.tensors.get(key)
        if info is None:
            raise CheckpointError(
                f"Checkpoint {self.storage.url!r} has no tensor {key!r}; it was saved from "
                f"another model or optimizer."
            )
        total = 1
        for dim in info["shape"]:
            total *= int(dim)
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(
                f"Range [{start}, {start + numel}) is outside tensor {key!r} of "
                f"{total} elements in {self.storage.url!r}."
            )
        out, raw = self._empty(numel, info["dtype"])
        if numel:
            self._fill(raw, raw.size // numel, key, info, start, numel)
        return out

    def _empty(self, numel: int, dtype: str) -> tuple[Any, Any]:
        """A new 1-D array of ``numel`` elements and its bytes (a uint8 numpy view)."""
        import numpy as np

        if self.numpy and dtype != "bfloat16":
            out = np.empty(numel, dtype=dtype)
            return out, out.view(np.uint8)
        import torch

        out = torch.empty(numel, dtype=getattr(torch, dtype))
        return out, out.view(torch.uint8).numpy()

    def _fill(self, raw: Any, size: int, key: str, info: dict, start: int, numel: int) -> None:
        end = start + numel
        for file, offset, piece_start, count in info["pieces"]:
            lo, hi = max(start, piece_start), min(end, piece_start + count)
            if lo >= hi:
                continue
            handle = self._handle(file)
            handle.seek(offset + (lo - piece_start) * size)
            view = memoryview(raw)[(lo - start) * size : (hi - start) * size]
            while len(view):
                got = handle.readinto(view)
                if not got:
                    raise CheckpointError(
                        f"Checkpoint {self.storage.url!r}: {file!r} ended early while reading "
                        f"{key!r}; the file is truncated."
                    )
                view = view[got:]

    def _handle(self, file: str) -> IO[bytes]:
        handle = self._handles.get(file)
        if handle is None:
            if self.storage.local:
                handle = open(self.storage.path(file), "rb")  # noqa: SIM115 (closed in close())
            else:
                handle = self.storage.open_read(file)
            self._handles[file] = handle
        return handle

    def close(self) -> None:
        """Close the open files."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> DirReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
