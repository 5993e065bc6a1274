"""``Checkpoint``: a directory of files, local or in fsspec storage (Ray Train's shape).

A loop reports one with ``report(metrics, checkpoint=Checkpoint.from_directory(d))``;
every worker copies its directory's files into the run's storage, and the copy is
committed (a ``COMMITTED`` marker written last) once every rank has reported that
step. ``get_checkpoint()`` and ``Result.checkpoint`` return such committed copies.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from polytrain.checkpoint.storage import Storage, is_url, normalize
from polytrain.errors import CheckpointError, ConfigError, ConfigTypeError

#: Files the function API adds to a committed checkpoint (besides the commit marker).
INTERNAL_PREFIX = ".polytrain"


#: Written into a checkpoint directory before the report: ``{"index": report number}``. It
#: marks the directory as the run's (custom ``checkpoint_dir_name``\ s included), so the
#: files of a report that never committed are removed when the group restarts.
REPORT_FILE = ".polytrain_report.json"
#: Ray Train's file of a checkpoint's user metadata.
METADATA_FILE = ".metadata.json"


class Checkpoint:
    """A checkpoint directory: a local path or an fsspec URL (``s3://...``), Ray Train's ``Checkpoint``.

    Args:
        path: the directory.
        filesystem: a ``pyarrow.fs.FileSystem`` that ``path`` is relative to (Ray
            Train's form: ``S3FileSystem``, ``LocalFileSystem``, or an fsspec filesystem
            wrapped in ``PyFileSystem(FSSpecHandler(...))``); None: ``path`` is a local
            path or an fsspec URL.

    Attributes:
        path: the directory as given (relative to ``filesystem`` when there is one).
        location: where polytrain reads and writes it: a local path or fsspec URL.

    Raises:
        ConfigTypeError: ``path`` not a path.
        ConfigError: a ``filesystem`` polytrain cannot address (it says which work).

    Example:
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        ...     polytrain.train.report({"loss": loss}, checkpoint=Checkpoint.from_directory(d))
    """

    def __init__(self, path: str | os.PathLike, filesystem: Any = None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigTypeError(
                f"Checkpoint path must be a directory path or URL; got "
                f"{type(path).__name__}: {path!r}."
            )
        if filesystem is None:
            self.path = normalize(path)
            self.location = self.path
        else:
            self.path = os.fspath(path)
            self.location = pyarrow_location(filesystem, self.path)
        self._filesystem = filesystem

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        """The checkpoint of the files in ``path``, a directory that exists.

        Raises:
            CheckpointError: ``path`` does not exist or is not a directory.
        """
        checkpoint = cls(path)
        storage = Storage(checkpoint.location)
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
        """The ``pyarrow.fs.FileSystem`` of :attr:`path` (Ray Train's meaning)."""
        if self._filesystem is not None:
            return self._filesystem
        return pyarrow_filesystem(self.location)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files into ``path`` (a new temporary directory if None); returns it."""
        target = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint_")
        os.makedirs(target, exist_ok=True)
        storage = Storage(self.location)
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
        if not is_url(self.location):
            yield self.location
            return
        target = self.to_directory()
        try:
            yield target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    # ----------------------------------------------------------------- metadata
    def get_metadata(self) -> dict[str, Any]:
        """The checkpoint's metadata dict (``{}`` when none was set)."""
        storage = Storage(self.location)
        try:
            return json.loads(storage.read_bytes(METADATA_FILE))
        except FileNotFoundError:
            return {}

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace the checkpoint's metadata (JSON-able), stored with its files.

        Raises:
            ConfigTypeError: not a dict, or not JSON-able.
        """
        if not isinstance(metadata, dict):
            raise ConfigTypeError(
                f"Checkpoint metadata must be a dict; got {type(metadata).__name__}: {metadata!r}."
            )
        try:
            data = json.dumps(metadata).encode()
        except TypeError as exc:
            raise ConfigTypeError(f"Checkpoint metadata must be JSON-serializable: {exc}") from exc
        Storage(self.location).write_bytes(METADATA_FILE, data)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Update the checkpoint's metadata with ``metadata``'s keys."""
        self.set_metadata({**self.get_metadata(), **metadata})

    def __repr__(self) -> str:
        # Ray Train's form: Checkpoint(filesystem=local, path=/runs/x/checkpoint_000001)
        kind = "local" if not is_url(self.location) else self.location.split("://", 1)[0]
        if self._filesystem is not None:
            kind = getattr(self._filesystem, "type_name", kind)
        return f"{type(self).__name__}(filesystem={kind}, path={self.path})"

    def __fspath__(self) -> str:
        return self.location

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)


def kind_of(checkpoint: Checkpoint) -> str | None:
    """``module:qualname`` of a :class:`Checkpoint` subclass (``TorchCheckpoint``), None for the base."""
    cls = type(checkpoint)
    return None if cls is Checkpoint else f"{cls.__module__}:{cls.__qualname__}"


def checkpoint_of(location: str, kind: str | None = None, **kwargs: Any) -> Checkpoint:
    """The checkpoint at ``location``, of the class ``kind`` names when it can be imported.

    The class a loop reported (``TorchCheckpoint``) comes back in ``Result`` and
    ``get_all_reported_checkpoints``, as in Ray Train.
    """
    cls: type[Checkpoint] = Checkpoint
    if kind:
        module_name, _, qualname = kind.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                found = getattr(found, part)
            if isinstance(found, type) and issubclass(found, Checkpoint):
                cls = found
        except (ImportError, AttributeError):
            pass  # defined where the driver cannot import it: a plain Checkpoint
    return cls(location, **kwargs)


def pyarrow_location(filesystem: Any, path: str) -> str:
    """A polytrain location (local path or fsspec URL) of ``path`` on a ``pyarrow.fs`` filesystem.

    Raises:
        ConfigError: a filesystem polytrain cannot address by URL.
    """
    type_name = getattr(filesystem, "type_name", None)
    if type_name == "local":
        return normalize(path)
    if type_name in _PYARROW_SCHEMES:
        return f"{_PYARROW_SCHEMES[type_name]}://{path.lstrip('/')}"
    handler = getattr(filesystem, "handler", None)
    fs = getattr(handler, "fs", None)
    if str(type_name).startswith("py") and fs is not None:
        return fsspec_location(fs, path)
    raise ConfigError(
        f"storage_filesystem / Checkpoint(filesystem={filesystem!r}) is not one polytrain can "
        f"address: use pyarrow's LocalFileSystem, S3FileSystem, GcsFileSystem, "
        f"HadoopFileSystem, or an fsspec filesystem in pyarrow.fs.PyFileSystem(FSSpecHandler(fs)) "
        f"-- or pass a URL (s3://..., gs://...) as the path instead."
    )


_PYARROW_SCHEMES = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}


def fsspec_location(fs: Any, path: str) -> str:
    """A polytrain location of ``path`` on the fsspec filesystem ``fs`` (a ``DirFileSystem`` too)."""
    inner = getattr(fs, "fs", None)
    if inner is not None and hasattr(fs, "_join"):  # fsspec's DirFileSystem: a prefix on another fs
        return fsspec_location(inner, fs._join(path))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return normalize(path)
    return fs.unstrip_protocol(path)


def pyarrow_filesystem(location: str) -> Any:
    """The ``pyarrow.fs.FileSystem`` of a polytrain location (local, or fsspec wrapped for pyarrow)."""
    import pyarrow.fs

    if not is_url(location):
        return pyarrow.fs.LocalFileSystem()
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(Storage(location).fs))


def upload(source: Checkpoint, target: Storage) -> None:
    """Worker: copy ``source``'s files into ``target`` (files of other ranks stay)."""
    src = Storage(source.location)
    target.makedirs()
    if src.local and target.local:
        shutil.copytree(src.path(), target.path(), dirs_exist_ok=True)
        return
    with source.as_directory() as local:
        target.fs.put(local.rstrip("/") + "/", target.path().rstrip("/") + "/", recursive=True)
