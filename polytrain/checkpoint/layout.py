"""The checkpoint directory layout: names, the manifest, the commit marker, validation.

A checkpoint written by the workers is a directory::

    <checkpoint_dir>/checkpoint_000003/        # after 3 epochs (checkpoint_000003.00000040: mid-epoch)
        rank_00000.bin  rank_00001.bin ...     # raw tensor bytes, one file per writing rank
        rank_00000.json rank_00001.json ...    # what each rank wrote (ranges of which tensors)
        meta.pt                                # the small rest: param groups, schedulers, ... (torch.save)
        manifest.json                          # format, framework, backend, world size, epoch, step,
                                               # and for every tensor its shape, dtype and pieces
        COMMITTED                              # written last: without it the directory is never loaded

Tensors are stored flattened, as contiguous ranges (see
:mod:`polytrain.checkpoint.pieces`); ``rank_*.bin`` hold raw bytes at the
offsets the manifest records, so reading needs no unpickling at all, and
``meta.pt`` is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.storage import Storage, check_readable, describe
from polytrain.errors import CheckpointError

DIR_FORMAT = "polytrain-dir"
DIR_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
META = "meta.pt"
META_JSON = "meta.json"
_NAME = re.compile(r"^checkpoint_(\d{6})(?:\.(\d{8}))?$")

#: dtype names a manifest may use (anything else is refused, never evaluated).
DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128",
)  # fmt: skip


def checkpoint_name(epoch: int, step_in_epoch: int | None = None) -> str:
    """``checkpoint_000003`` after 3 epochs; ``checkpoint_000003.00000040`` 40 steps into the 4th."""
    name = f"checkpoint_{int(epoch):06d}"
    return name if step_in_epoch is None else f"{name}.{int(step_in_epoch):08d}"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(epoch, step_in_epoch)`` of a checkpoint directory name (step -1 at an epoch end), or None."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)) if match.group(2) else -1


def rank_file(rank: int, suffix: str) -> str:
    """``rank_00003.bin`` / ``rank_00003.json``."""
    return f"rank_{rank:05d}.{suffix}"


def tensor_key(path: tuple[Any, ...]) -> str:
    """The manifest key of a tensor path: its parts, URL-quoted, joined by ``/``."""
    return "/".join(urllib.parse.quote(str(part), safe="") for part in path)


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------- manifest
def merge_rank_indexes(indexes: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """The manifest's ``tensors`` table from every rank's index, checked for full coverage.

    Raises:
        CheckpointError: a tensor whose pieces overlap, leave a gap, or disagree on shape/dtype.
    """
    tensors: dict[str, dict[str, Any]] = {}
    for index in indexes:
        for entry in index["entries"]:
            key = tensor_key(tuple(entry["path"]))
            info = tensors.setdefault(
                key,
                {
                    "path": entry["path"],
                    "shape": entry["shape"],
                    "dtype": entry["dtype"],
                    "pieces": [],
                },
            )
            if info["shape"] != entry["shape"] or info["dtype"] != entry["dtype"]:
                raise CheckpointError(
                    f"Checkpoint {source!r}: ranks disagree on tensor {key!r} (shape "
                    f"{info['shape']} / {entry['shape']}, dtype {info['dtype']} / {entry['dtype']})."
                )
            info["pieces"].append([index["file"], entry["offset"], entry["start"], entry["numel"]])
    for key, info in tensors.items():
        info["pieces"].sort(key=lambda piece: piece[2])
        _check_coverage(key, info, source)
    return tensors


def _check_coverage(key: str, info: dict[str, Any], source: str) -> None:
    numel = 1
    for dim in info["shape"]:
        numel *= int(dim)
    position = 0
    for _, _, start, count in info["pieces"]:
        if start != position:
            raise CheckpointError(
                f"Checkpoint {source!r}: tensor {key!r} has "
                f"{'overlapping pieces' if start < position else 'a gap'} at element {position} "
                f"(pieces {info['pieces'][:6]}); the ranks did not write one complete copy."
            )
        position += count
    if position != numel:
        raise CheckpointError(
            f"Checkpoint {source!r}: tensor {key!r} of shape {info['shape']} has {position} of "
            f"its {numel} elements written."
        )


def build_manifest(header: dict[str, Any], indexes: list[dict[str, Any]], source: str) -> dict:
    """The manifest: ``header`` (framework, backend, world size, epoch, step), files and tensors."""
    files = {}
    for index in indexes:
        if index.get("file"):
            files[index["file"]] = {
                "holds": f"tensor ranges written by rank {index['rank']}",
                "bytes": index["bytes"],
            }
        if index.get("meta_bytes") is not None:
            files[index.get("meta_file", META)] = {
                "holds": "the checkpoint without its tensors: param groups, schedulers, "
                "operator, step, epoch",
                "bytes": index["meta_bytes"],
            }
    return {
        "format": DIR_FORMAT,
        "version": DIR_VERSION,
        **header,
        "writers": len(indexes),
        "files": files,
        "tensors": merge_rank_indexes(indexes, source),
    }


# ------------------------------------------------------------- reading
@dataclass
class CheckpointDir:
    """A validated, committed checkpoint directory.

    Attributes:
        storage: the directory.
        manifest: the parsed ``manifest.json``.
        meta: the parsed ``meta.pt`` (the consolidated envelope without tensors).
    """

    storage: Storage
    manifest: dict[str, Any]
    meta: dict[str, Any] = field(repr=False)

    @property
    def url(self) -> str:
        """The directory's path or URL."""
        return self.storage.url


def is_checkpoint_dir(path: Any) -> bool:
    """Whether ``path`` (local or URL) is a directory, i.e. to be read as a checkpoint directory."""
    storage = Storage(path)
    try:
        return bool(storage.fs.isdir(storage.path()))
    except OSError:
        return False


def is_committed(storage: Storage) -> bool:
    """Whether the checkpoint directory has its commit marker."""
    return storage.exists(MARKER)


def open_checkpoint(path: Any, framework: str | None = None) -> CheckpointDir:
    """Read and validate a checkpoint directory without loading its tensors.

    Raises:
        CheckpointError: no commit marker (an interrupted save), an unreadable or foreign
            manifest, a missing or truncated file, or a checkpoint of another framework.
    """
    storage = Storage(path)
    source = storage.url
    if not storage.exists(MARKER):
        raise CheckpointError(
            f"Checkpoint directory {source!r} has no {MARKER} marker: its save did not complete "
            f"(interrupted, or still being written), so it is never loaded. Load the previous "
            f"checkpoint in its directory."
        )
    manifest = _read_manifest(storage, source)
    for name, info in manifest["files"].items():
        check_readable(storage, name, info.get("bytes"), source)
    meta = _read_meta(storage, source, META_JSON if META_JSON in manifest["files"] else META)
    ckpt.validate_checkpoint(meta, source, framework)
    return CheckpointDir(storage=storage, manifest=manifest, meta=meta)


def _read_manifest(storage: Storage, source: str) -> dict[str, Any]:
    try:
        manifest = json.loads(storage.read_bytes(MANIFEST))
    except FileNotFoundError:
        raise CheckpointError(
            f"Checkpoint directory {source!r} has no {MANIFEST}; it is not a polytrain "
            f"checkpoint directory."
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"Checkpoint directory {source!r}: {MANIFEST} is not valid JSON ({exc}); the "
            f"checkpoint is corrupted. Load another one."
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != DIR_FORMAT:
        raise CheckpointError(
            f"{source!r} is not a polytrain checkpoint directory (its {MANIFEST} has format "
            f"{describe(manifest.get('format') if isinstance(manifest, dict) else manifest)}, "
            f"expected {DIR_FORMAT!r})."
        )
    if int(manifest.get("version", 0)) > DIR_VERSION:
        raise CheckpointError(
            f"Checkpoint directory {source!r} has layout version {manifest['version']}; this "
            f"polytrain reads versions up to {DIR_VERSION}. Upgrade polytrain."
        )
    for key in ("files", "tensors", "framework"):
        if key not in manifest:
            raise CheckpointError(f"Checkpoint directory {source!r}: {MANIFEST} lacks {key!r}.")
    for key, info in manifest["tensors"].items():
        if info.get("dtype") not in DTYPES:
            raise CheckpointError(
                f"Checkpoint directory {source!r}: tensor {key!r} has dtype "
                f"{describe(info.get('dtype'))}; allowed: {', '.join(DTYPES)}."
            )
    return manifest


def _read_meta(storage: Storage, source: str, name: str) -> dict[str, Any]:
    """``meta.pt`` (``torch.load(weights_only=True)``) or ``meta.json``."""
    try:
        data = storage.read_bytes(name)
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint directory {source!r} has no {name}.") from None
    try:
        if name == META_JSON:
            return json.loads(data)
        import torch

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises many types; none may pass as a load
        raise CheckpointError(
            f"Could not read {name} of checkpoint {source!r}: {type(exc).__name__}: "
            f"{str(exc)[:300]}. It is truncated, corrupted or not written by polytrain; "
            f"nothing was loaded."
        ) from exc


# -------------------------------------------------------- a directory of them
def list_checkpoint_dirs(root: Storage) -> list[tuple[tuple[int, int], str]]:
    """``((epoch, step_in_epoch), name)`` of every checkpoint directory below ``root``, oldest first."""
    found = []
    for name in root.listdir():
        order = parse_name(name)
        if order is not None:
            found.append((order, name))
    return sorted(found)


def latest_committed(root: Storage) -> str | None:
    """The URL of the newest committed checkpoint directory below ``root``, or None."""
    for _, name in reversed(list_checkpoint_dirs(root)):
        if is_committed(root.child(name)):
            return root.url_of(name)
    return None


def newest_loadable(
    root: Storage, framework: str | None = None
) -> tuple[CheckpointDir | None, list[tuple[str, str]]]:
    """The newest checkpoint below ``root`` that validates, and the newer ones skipped on the way.

    A directory without its commit marker (an interrupted save) and a committed one
    that fails validation (a truncated or missing rank file, a corrupted manifest or
    ``meta.pt``) are skipped, each with the reason, newest first.

    Returns:
        ``(checkpoint or None, [(url, reason), ...])``.
    """
    skipped: list[tuple[str, str]] = []
    for _, name in reversed(list_checkpoint_dirs(root)):
        url = root.url_of(name)
        if not is_committed(root.child(name)):
            skipped.append((url, f"no {MARKER} marker: its save did not complete"))
            continue
        try:
            return open_checkpoint(url, framework), skipped
        except CheckpointError as exc:
            skipped.append((url, str(exc)))
    return None, skipped


def prune(root: Storage, num_to_keep: int, keep: set[str] = frozenset()) -> list[str]:
    """Delete all but the newest ``num_to_keep`` committed checkpoints below ``root``.

    Uncommitted directories older than the newest committed one (interrupted saves)
    go too; newer ones may still be being written and stay. Names in ``keep`` stay.

    Returns:
        The names deleted.
    """
    entries = list_checkpoint_dirs(root)
    committed = [name for _, name in entries if is_committed(root.child(name))]
    newest = committed[-1] if committed else None
    doomed = set(committed[:-num_to_keep]) if num_to_keep else set(committed)
    if newest is not None:
        newest_order = parse_name(newest)
        doomed |= {
            name for order, name in entries if name not in committed and order < newest_order
        }
    doomed -= set(keep)
    for name in sorted(doomed):
        root.remove(name)
    return sorted(doomed)
