"""The worker's side of a checkpoint save, for any framework: plan, snapshot, write (maybe in the background).

A synchronous save writes this rank's files before returning. An asynchronous
save copies this rank's pieces into host memory (the only stall training sees),
starts a background thread that writes them (rank 0 then commits the
directory, marker last) and returns at once. One save is in flight per worker:
the next save, a load and :func:`flush` wait for the previous one first.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from polytrain.errors import CheckpointError
from polytrain.launchers.worker import WORKER_STATE

if TYPE_CHECKING:  # torch is imported only by a save: a TensorFlow worker's flush stays light
    from polytrain.checkpoint.directory import SaveRequest
    from polytrain.checkpoint.pieces import LocalState

logger = logging.getLogger(__name__)

_WRITER_KEY = "polytrain.checkpoint_writer"


class BackgroundWriter:
    """The one background checkpoint write of this worker process."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.url: str | None = None
        self.error: str | None = None
        #: Host buffers reused by every asynchronous snapshot (one save in flight at a time).
        self.staging: dict[tuple, Any] = {}

    def start(self, url: str, write: Any) -> None:
        """Run ``write()`` in a daemon thread (after the previous write finished)."""
        self.wait()
        self.url, self.error = url, None

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # reported by wait(); the checkpoint stays uncommitted
                self.error = f"{type(exc).__name__}: {exc}"
                logger.error("Background checkpoint write to %s failed: %s", url, self.error)

        self.thread = threading.Thread(target=run, name="polytrain-checkpoint", daemon=True)
        self.thread.start()

    def wait(self) -> dict[str, Any]:
        """Wait for the write in flight; returns ``{"path", "error", "waited_s"}`` of the last write."""
        begin = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return {"path": self.url, "error": self.error, "waited_s": time.perf_counter() - begin}


def writer() -> BackgroundWriter:
    """This worker's :class:`BackgroundWriter`."""
    found = WORKER_STATE.get(_WRITER_KEY)
    if found is None:
        found = WORKER_STATE[_WRITER_KEY] = BackgroundWriter()
    return found


def flush() -> dict[str, Any]:
    """Worker: wait until this worker's background checkpoint write (if any) is done."""
    return writer().wait()


def sees(directory: str, name: str) -> bool:
    """Worker: whether file ``name`` in ``directory`` (a path or URL) is visible from this worker."""
    from polytrain.checkpoint.storage import Storage

    return Storage(directory).exists(name)


def save_local_state(
    request: SaveRequest,
    rank: int,
    world_size: int,
    local: LocalState,
    meta_state: dict[str, Any] | None,
    rng: dict[str, Any] | None = None,
    meta_format: str = "pt",
) -> dict[str, Any]:
    """Worker: write this rank's share of ``local`` to ``request.url`` (in the background if asked).

    A framework's checkpoint module says what the state is; this writes it (its one way
    to :mod:`polytrain.checkpoint.directory`).

    Args:
        request: where, what, and whether asynchronously.
        rank: this worker's rank, of ``world_size``.
        world_size: the number of ranks.
        local: this rank's pieces (and, on rank 0, the skeleton already inside ``meta_state``).
        meta_state: rank 0: the checkpoint's meta (envelope, skeleton, trainer state);
            None on the other ranks.
        rng: this rank's random generator states, taken now (written with its index).
        meta_format: ``"pt"`` (``meta.pt``, torch) or ``"json"`` (``meta.json``, no torch).

    Returns:
        Small metadata for the driver: ``path``, ``rank``, ``bytes``, ``pending`` (the
        write continues in the background), ``snapshot_s`` / ``write_s``, and
        ``previous_error`` when the previous background write failed.
    """
    from polytrain.checkpoint.directory import plan_pieces, snapshot, write_part
    from polytrain.checkpoint.pieces import nbytes

    begin = time.perf_counter()
    meta = _meta_file(meta_state, meta_format)
    previous = writer().wait()
    mine = plan_pieces(local.pieces, rank, world_size)
    result: dict[str, Any] = {"path": request.url, "rank": rank, "pending": request.asynchronous}
    result.update(bytes=sum(nbytes(p.tensor) for p in mine), waited_s=previous["waited_s"])
    if previous["error"]:
        result.update(previous_error=previous["error"], previous_path=previous["path"])
    if request.asynchronous:  # copy to host memory now, write in the background
        frozen = snapshot(mine, copy=True, staging=writer().staging)
        result["snapshot_s"] = time.perf_counter() - begin
        writer().start(
            request.url, partial(write_part, request, rank, world_size, frozen, meta, rng)
        )
        return result
    try:
        write_part(request, rank, world_size, snapshot(mine, copy=False), meta, rng)
    except (OSError, CheckpointError) as exc:
        # Disk full, permission lost, a remote store that errors: the checkpoint stays
        # uncommitted (never loaded), the previous one is untouched; the driver decides.
        result["error"] = describe_write_error(request.url, exc)
        mark_failed(request.url, rank)
        logger.error("Checkpoint write failed on rank %d: %s", rank, result["error"])
    result["write_s"] = time.perf_counter() - begin
    return result


def _meta_file(meta_state: dict[str, Any] | None, meta_format: str) -> tuple[str, bytes] | None:
    """Rank 0's meta file (name, bytes): ``meta.pt`` or ``meta.json``; None on the other ranks."""
    if meta_state is None:
        return None
    from polytrain.checkpoint.directory import meta_bytes, meta_json

    return (meta_json if meta_format == "json" else meta_bytes)(meta_state)


def describe_write_error(url: str, exc: BaseException) -> str:
    """``exc`` of a failed checkpoint write as one line naming the path and the cause (errno name)."""
    import errno

    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    where = getattr(exc, "filename", None) or url
    return f"writing {where} failed: {type(exc).__name__}{f' [{name}]' if name else ''}: {exc}"


def mark_failed(url: str, rank: int) -> None:
    """Leave an empty ``rank_NNNNN.failed`` file so that rank 0 stops waiting for this rank (best effort)."""
    from polytrain.checkpoint.directory import failure_marker
    from polytrain.checkpoint.storage import Storage

    try:
        storage = Storage(url)
        storage.fs.touch(storage.path(failure_marker(rank)))
    except Exception:  # noqa: BLE001 (rank 0 then waits up to commit_timeout_s)
        logger.warning("Could not mark rank %d's failed checkpoint write in %s", rank, url)
