"""``Checkpoint``: a directory of files, local or in fsspec storage (Ray Train's shape).

A loop reports one with ``report(metrics, checkpoint=Checkpoint.from_directory(d))``;
every worker copies its directory's files into the run's storage, and the copy is
committed (a ``COMMITTED`` marker written last) once every rank has reported that
step. ``get_checkpoint()`` and ``Result.checkpoint`` return such committed copies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from polytrain.checkpoint.storage import Storage, is_url, normalize
from polytrain.errors import CheckpointError, ConfigTypeError

#: Files the function API adds to a committed checkpoint (besides the commit marker).
INTERNAL_PREFIX = ".polytrain"


class Checkpoint:
    """A checkpoint directory: a local path or an fsspec URL (``s3://...``).

    Args:
        path: the directory.

    Example:
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        ...     polytrain.train.report({"loss": loss}, checkpoint=Checkpoint.from_directory(d))
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigTypeError(
                f"Checkpoint path must be a directory path or URL; got "
                f"{type(path).__name__}: {path!r}."
            )
        self.path = normalize(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        """The checkpoint of the files in ``path``, a directory that exists.

        Raises:
            CheckpointError: ``path`` does not exist or is not a directory.
        """
        checkpoint = cls(path)
        storage = Storage(checkpoint.path)
        if not storage.fs.isdir(storage.path()):
            what = "is a file" if storage.exists() else "does not exist"
            raise CheckpointError(
                f"Checkpoint.from_directory({os.fspath(path)!r}): the path {what}; a checkpoint "
                f"is a directory. Write your files into a directory (e.g. "
                f"tempfile.TemporaryDirectory()) and pass that."
            )
        return checkpoint

    @property
    def filesystem(self) -> Any:
        """The ``fsspec`` filesystem the checkpoint lives on."""
        return Storage(self.path).fs

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files into ``path`` (a new temporary directory if None); returns it."""
        target = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint_")
        os.makedirs(target, exist_ok=True)
        storage = Storage(self.path)
        if storage.local:
            shutil.copytree(storage.path(), target, dirs_exist_ok=True)
        else:
            storage.fs.get(
                storage.path().rstrip("/") + "/", target.rstrip("/") + "/", recursive=True
            )
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the checkpoint's files: the path itself when local, else a copy."""
        if not is_url(self.path):
            yield self.path
            return
        target = self.to_directory()
        try:
            yield target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


def upload(source: Checkpoint, target: Storage) -> None:
    """Worker: copy ``source``'s files into ``target`` (files of other ranks stay)."""
    src = Storage(source.path)
    target.makedirs()
    if src.local and target.local:
        shutil.copytree(src.path(), target.path(), dirs_exist_ok=True)
        return
    with source.as_directory() as local:
        target.fs.put(local.rstrip("/") + "/", target.path().rstrip("/") + "/", recursive=True)
