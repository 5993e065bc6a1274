"""Worker side of ``report(checkpoint=...)``: how a checkpoint reaches the run's storage, in report order.

Ray Train's three :class:`~polytrain.train.CheckpointUploadMode`\\ s: ``SYNC`` copies
the files before ``report`` returns; ``ASYNC`` hands the copy and the report to one
background thread of the worker (reports keep their order; ``report`` returns at
once; an upload error ends the loop at its next ``report``, collective or return);
``NO_UPLOAD`` registers a directory the loop already wrote below the run's
directory. ``checkpoint_upload_fn(checkpoint, dir_name)`` replaces the copy with
your own (it must return the checkpoint in the run's directory under that name), and
``delete_local_checkpoint_after_upload`` removes the source afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from polytrain.checkpoint.storage import Storage, is_url, normalize
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.train.checkpoint import REPORT_FILE, Checkpoint, upload
from polytrain.train.reporting import CheckpointUploadMode

logger = logging.getLogger(__name__)


def check_mode(mode: Any) -> CheckpointUploadMode:
    """The upload mode from a :class:`CheckpointUploadMode` or its name.

    Raises:
        ConfigTypeError: anything else.
    """
    if isinstance(mode, CheckpointUploadMode):
        return mode
    if isinstance(mode, str) and mode.upper() in CheckpointUploadMode.__members__:
        return CheckpointUploadMode[mode.upper()]
    raise ConfigTypeError(
        f"report(checkpoint_upload_mode={mode!r}) must be a CheckpointUploadMode: "
        f"{[m.name for m in CheckpointUploadMode]}."
    )


def check_dir_name(name: Any) -> str | None:
    """A ``checkpoint_dir_name``: one folder name below the run's directory, or None.

    Raises:
        ConfigError: a path, an empty or hidden name.
    """
    if name is None:
        return None
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name[0] == ".":
        raise ConfigError(
            f"report(checkpoint_dir_name={name!r}) must be a folder name (no '/', not empty, not "
            f"starting with '.'), unique per report, e.g. f'checkpoint_epoch={{epoch}}'."
        )
    return name


def _same_place(a: str, b: str) -> bool:
    return normalize(a).rstrip("/") == normalize(b).rstrip("/")


class Uploader:
    """One worker's checkpoint uploads and reports, in order (a background thread for ASYNC).

    Args:
        run_url: the run's directory.
    """

    def __init__(self, run_url: str) -> None:
        self.root = Storage(run_url)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []

    # ------------------------------------------------------------------ ordering
    def submit(self, job: Callable[[], Any], background: bool) -> Any:
        """Run ``job`` after every earlier one; in the background thread when ``background``."""
        if background:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "polytrain-upload")
            self._futures.append(self._pool.submit(job))
            return None
        self.flush()
        return job()

    def flush(self) -> None:
        """Wait for every background report; raise the first one's error."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def close(self) -> None:
        """Wait for the background reports (raising their error), then stop the thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # ------------------------------------------------------------------ one checkpoint
    def check_source(
        self, checkpoint: Checkpoint, mode: CheckpointUploadMode, delete_after: bool
    ) -> None:
        """Refuse what cannot work before the report is counted.

        Raises:
            ConfigError: NO_UPLOAD of a directory outside the run's, or deleting a
                directory that holds the run's.
        """
        location = checkpoint.location
        if mode == CheckpointUploadMode.NO_UPLOAD:
            parent = location.rstrip("/").rsplit("/", 1)[0]
            if not _same_place(parent, self.root.url):
                raise ConfigError(
                    f"report(checkpoint_upload_mode=NO_UPLOAD): the checkpoint {location!r} is not a "
                    f"directory directly below the run's directory {self.root.url!r}. Write it there "
                    f"(get_context().get_storage().experiment_fs_path), or let report upload it "
                    f"(SYNC / ASYNC)."
                )
        if delete_after and not is_url(location) and not is_url(self.root.url):
            source = os.path.realpath(location)
            run = os.path.realpath(self.root.url)
            if run == source or run.startswith(source.rstrip("/") + "/"):
                raise ConfigError(
                    f"report(delete_local_checkpoint_after_upload=True) would delete the checkpoint "
                    f"{location!r}, which holds the run's directory {self.root.url!r}. Write the "
                    f"checkpoint to a temporary directory, or pass "
                    f"delete_local_checkpoint_after_upload=False."
                )

    def store(
        self,
        checkpoint: Checkpoint,
        name: str,
        index: int,
        mode: CheckpointUploadMode,
        delete_after: bool,
        upload_fn: Callable[[Checkpoint, str], Checkpoint] | None,
    ) -> str:
        """Put ``checkpoint`` into the run's directory ``name``; returns the name used.

        Raises:
            ConfigError: an upload function that returned something else than a
                checkpoint at ``<run>/<name>``.
        """
        if mode == CheckpointUploadMode.NO_UPLOAD:
            name = checkpoint.location.rstrip("/").rsplit("/", 1)[1]
            self._mark(name, index)
            return name
        self._mark(name, index)
        target = self.root.child(name)
        if upload_fn is not None:
            stored = upload_fn(checkpoint, name)
            if not isinstance(stored, Checkpoint):
                raise ConfigTypeError(
                    f"checkpoint_upload_fn must return a polytrain.train.Checkpoint; it returned "
                    f"{type(stored).__name__}: {stored!r}."
                )
            if not _same_place(stored.location, target.url):
                raise ConfigError(
                    f"checkpoint_upload_fn returned {stored!r}, outside the run: it must write to "
                    f"{target.url!r} (the run's directory / the checkpoint_dir_name it is given) "
                    f"and return that checkpoint."
                )
        else:
            upload(checkpoint, target)
        if delete_after:
            self._delete(checkpoint)
        return name

    def _mark(self, name: str, index: int) -> None:
        self.root.child(name).write_bytes(REPORT_FILE, json.dumps({"index": index}).encode())

    @staticmethod
    def _delete(checkpoint: Checkpoint) -> None:
        try:
            if is_url(checkpoint.location):
                Storage(checkpoint.location).remove()
            else:
                shutil.rmtree(checkpoint.location)
        except Exception:  # the copy is committed; a leftover source is only disk space
            logger.exception(
                "Could not delete the local checkpoint %s after its upload.", checkpoint
            )
