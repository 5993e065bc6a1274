"""Where checkpoints live: a local directory or any ``fsspec`` URL (``s3://``, ``gs://``, ``memory://``).

Workers write their parts of a checkpoint and the driver lists, validates and
prunes checkpoints through the same :class:`Storage`, so a checkpoint directory
on shared storage (NFS, an object store) serves a multi-node run. ``fsspec``
comes with torch and ``ray[tune]``; remote protocols need their own package
(``s3fs``, ``gcsfs``, ``adlfs``).

Writes are atomic per file: on a local filesystem through a temporary file,
``fsync`` and a rename; on an object store an object appears whole when its
upload completes.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

from polytrain.errors import CheckpointError, ConfigError

_LOCAL_PROTOCOLS = ("file", "local")


def is_url(path: str | os.PathLike) -> bool:
    """True for ``protocol://...`` (fsspec) locations, False for plain local paths."""
    return "://" in str(path)


def normalize(path: str | os.PathLike) -> str:
    """A local path made absolute (``~`` expanded), or a URL without a trailing slash."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_url(text):
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


class Storage:
    """A directory on a local or remote filesystem; paths below it are relative names.

    Args:
        url: a local directory or an fsspec URL.

    Raises:
        ConfigError: the URL's protocol needs a package that is not installed.
    """

    def __init__(self, url: str | os.PathLike) -> None:
        self.url = normalize(url)
        try:
            from fsspec.core import url_to_fs

            self.fs, self.root = url_to_fs(self.url)
        except ImportError as exc:
            raise ConfigError(
                f"Checkpoint location {self.url!r} needs a filesystem package: {exc}. Install it "
                f"(e.g. pip install s3fs / gcsfs / adlfs), or use a local or NFS path."
            ) from exc
        except ValueError as exc:
            raise ConfigError(
                f"Checkpoint location {self.url!r} is not a valid path or fsspec URL: {exc}."
            ) from exc
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self.local = any(p in _LOCAL_PROTOCOLS for p in protocols)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # --------------------------------------------------------------- names
    def path(self, name: str = "") -> str:
        """The filesystem path of ``name`` below this directory."""
        return f"{self.root.rstrip('/')}/{name}" if name else self.root

    def url_of(self, name: str) -> str:
        """The URL (or local path) of ``name`` below this directory."""
        return f"{self.url}/{name}"

    def child(self, name: str) -> Storage:
        """The sub-directory ``name``."""
        return Storage(self.url_of(name))

    # ------------------------------------------------------------- queries
    def exists(self, name: str = "") -> bool:
        """Whether ``name`` (or this directory) exists."""
        return bool(self.fs.exists(self.path(name)))

    def listdir(self) -> list[str]:
        """The names directly below this directory (empty if it does not exist)."""
        try:
            entries = self.fs.ls(self.path(), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def size(self, name: str) -> int:
        """The size of file ``name`` in bytes.

        Raises:
            FileNotFoundError: no such file.
        """
        return int(self.fs.size(self.path(name)))

    # ----------------------------------------------------------------- I/O
    def read_bytes(self, name: str) -> bytes:
        """The content of file ``name``."""
        with self.fs.open(self.path(name), "rb") as handle:
            return handle.read()

    def open_read(self, name: str) -> IO[bytes]:
        """A binary, seekable file object for ``name`` (the caller closes it)."""
        return self.fs.open(self.path(name), "rb")

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        """Write file ``name`` atomically: it appears whole when the block exits, or not at all."""
        self.makedirs()
        if not self.local:
            with self.fs.open(self.path(name), "wb") as handle:
                yield handle
            return
        target = self.path(name)
        tmp = f"{os.path.dirname(target)}/.{os.path.basename(target)}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
            fsync_path(os.path.dirname(target))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``data`` to file ``name`` atomically."""
        with self.open_write(name) as handle:
            handle.write(data)

    def makedirs(self) -> None:
        """Create this directory (and its parents) if missing."""
        self.fs.makedirs(self.path(), exist_ok=True)

    def remove(self, name: str = "") -> None:
        """Delete ``name`` (or this directory) with everything below it; missing is fine."""
        target = self.path(name)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a local file, or a directory's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def local_file_path(storage: Storage, name: str) -> str | None:
    """The OS path of ``name`` when ``storage`` is local (for ``readinto`` without fsspec)."""
    return storage.path(name) if storage.local else None


def check_readable(storage: Storage, name: str, expected_size: int | None, source: str) -> None:
    """Raise :class:`CheckpointError` unless file ``name`` exists (with ``expected_size`` bytes)."""
    try:
        size = storage.size(name)
    except FileNotFoundError:
        raise CheckpointError(
            f"Checkpoint {source!r} is incomplete: its file {name!r} is missing; nothing was "
            f"loaded. Load another checkpoint (the previous one in its directory)."
        ) from None
    if expected_size is not None and size != expected_size:
        raise CheckpointError(
            f"Checkpoint {source!r} is truncated or corrupted: {name!r} has {size} bytes, its "
            f"manifest says {expected_size}; nothing was loaded. Load another checkpoint."
        )


def describe(value: Any) -> str:
    """A short description of a value for error messages."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
