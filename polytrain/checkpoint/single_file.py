"""The portable checkpoint format: atomic writes, safe loading, validation.

A checkpoint is a dict saved with ``torch.save``::

    {"format": "polytrain", "version": 1, "framework": "torch", "backend": "ddp",
     "world_size": 2, "epoch": 3, "models": [...], "optimizers": [...],
     "schedulers": [...], "scaler": {...} | None, "operator": {...}}

Model and optimizer states are consolidated (unsharded) and keyed like a plain
single-process ``state_dict()``, so a checkpoint written under any backend and
world size loads under any other.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from polytrain.errors import CheckpointError

FORMAT = "polytrain"
VERSION = 1
REQUIRED_KEYS = ("format", "version", "framework", "epoch", "models")


def atomic_write(path: str | os.PathLike, write: Any) -> Path:
    """Write a file through ``write(file_object)`` so that ``path`` is never half-written.

    The data goes to a temporary file in the same directory, is flushed and
    fsync'ed, then renamed over ``path`` (atomic on POSIX). A crash at any moment
    leaves either the previous file or the new one, never a mix.
    """
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    return target


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Validate ``state`` and write it atomically to ``path``."""
    import torch  # here, not at the top: a TensorFlow driver imports torch only to save

    validate_checkpoint(state, str(path))
    return atomic_write(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: str | os.PathLike, framework: str | None = None) -> dict[str, Any]:
    """Read a polytrain checkpoint without unpickling arbitrary objects.

    Raises:
        CheckpointError: missing, truncated, corrupted, not a polytrain checkpoint, or
            written by a trainer of another framework.
    """
    import torch

    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist (or is not a file).")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        OSError,
        ValueError,
    ) as exc:
        raise CheckpointError(
            f"Could not read checkpoint {str(path)!r}: {type(exc).__name__}: {str(exc)[:300]}. "
            f"The file is truncated, corrupted, or not a checkpoint written by polytrain's "
            f"save(); nothing was loaded."
        ) from exc
    validate_checkpoint(state, str(path), framework)
    return state


def validate_checkpoint(state: Any, source: str = "state", framework: str | None = None) -> None:
    """Raise a :class:`CheckpointError` unless ``state`` is a polytrain checkpoint dict."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{source!r} is not a polytrain checkpoint (expected a dict with "
            f"format='{FORMAT}'; got {type(state).__name__}"
            + (f" with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) else "")
            + "). Load files written by trainer.save(); for a plain model state_dict use "
            "model.load_state_dict()."
        )
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(
            f"Checkpoint {source!r} lacks the key(s) {missing}; it is incomplete."
        )
    if state["version"] > VERSION:
        raise CheckpointError(
            f"Checkpoint {source!r} has format version {state['version']}; this polytrain reads "
            f"versions up to {VERSION}. Upgrade polytrain."
        )
    if framework is not None and state["framework"] != framework:
        raise CheckpointError(
            f"Checkpoint {source!r} was written by a {state['framework']} trainer and cannot be "
            f"loaded into a {framework} trainer."
        )


def epoch_checkpoint_path(directory: str | os.PathLike, epoch: int) -> Path:
    """The file name of the checkpoint written at the end of ``epoch`` in ``directory``."""
    return Path(directory).expanduser() / f"checkpoint_epoch_{epoch:06d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The epoch checkpoints in ``directory``, oldest first."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        return []
    return sorted(folder.glob("checkpoint_epoch_*.pt"))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest epoch checkpoint in ``directory`` (to resume a run), or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: str | os.PathLike, num_to_keep: int) -> None:
    """Delete all but the newest ``num_to_keep`` epoch checkpoints."""
    for old in list_checkpoints(directory)[:-num_to_keep]:
        old.unlink(missing_ok=True)
