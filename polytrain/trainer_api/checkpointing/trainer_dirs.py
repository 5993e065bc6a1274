"""The trainer's side of checkpoint directories: request them, keep their paths, restore, load.

:class:`CheckpointDirMixin` is mixed into :class:`~polytrain.trainer_api.trainer.BaseTrainer`
(before :class:`~polytrain.trainer_api.checkpointing.trainer_state.StateMixin`, whose file-based
restore and load it extends). The workers write every checkpoint themselves
(:mod:`polytrain.trainer_api.checkpointing.worker_writer`); the driver receives the
directory's path and a few numbers per rank, never a tensor. A restart after a
lost worker, an elastic resize and :meth:`load` of a directory have the new
workers read it, each only the ranges it holds.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, ClassVar

from polytrain.checkpoint import layout
from polytrain.checkpoint.directory import SaveRequest
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer_api.checkpointing import worker_writer as checkpoint_worker
from polytrain.trainer_api.checkpointing.recovery import RecoveryPoint

logger = logging.getLogger(__name__)

#: How long a planned stop (shutdown, elastic resize) waits for background checkpoint writes.
FLUSH_TIMEOUT_S = 600.0


class CheckpointDirMixin:
    """Checkpoint directories on the driver; mixed into ``BaseTrainer`` (which provides the attributes).

    A framework trainer sets :attr:`checkpoint_worker_module`: a module with
    ``load_dir(url) -> dict`` (run on every worker) for its workers.
    """

    #: The worker-side module of the framework (``load_dir``), or None: no directories.
    checkpoint_worker_module: ClassVar[Any] = None

    # ---------------------------------------------------------------- saving
    def _checkpoint_header(self, epoch: int) -> dict[str, Any]:
        """What a checkpoint's manifest records about the run (``epoch``: epochs completed)."""
        return {
            "framework": self.framework,
            "backend": self.backend.name,
            "world_size": self._group_size,
            "epoch": int(epoch),
            "global_step": int(self._global_step),
        }

    def _checkpoint_request(self, epoch: int, epoch_step: int = 0) -> SaveRequest:
        """Driver: a fresh checkpoint directory for the state at ``(epoch, epoch_step)``."""
        return self.checkpoint_manager.request(
            self._checkpoint_header(epoch),
            step_in_epoch=epoch_step or None,
            epoch_step=int(epoch_step),
        )

    def _workers_see_checkpoints(self) -> bool:
        """Driver: whether every worker of the group sees the checkpoint directory (asked once per group).

        Without a ``checkpoint_dir`` the directory is a temporary one on the driver's
        node: workers on other nodes do not see it, and the state then comes back
        through the driver instead (as a consolidated dict).

        Raises:
            ConfigError: a ``checkpoint_dir`` that some worker does not see.
        """
        if self.scaling.local_mode:
            return True
        if getattr(self, "_checkpoint_probe", None) is self._group:
            return self._checkpoint_shared
        root = self.checkpoint_manager.root()
        name = f".polytrain-probe-{uuid.uuid4().hex}"
        root.write_bytes(name, b"")
        try:
            seen = self._run(checkpoint_worker.sees, root.url, name)
        finally:
            root.remove(name)
        missing = [rank for rank, ok in enumerate(seen) if not ok]
        if missing and self.checkpoint.checkpoint_dir is not None:
            raise ConfigError(
                f"checkpoint_dir={self.checkpoint.checkpoint_dir!r} is not visible from worker "
                f"rank(s) {missing} (another node?). The workers write checkpoints there "
                f"themselves: use storage every node sees (NFS, or an fsspec URL such as "
                f"s3://bucket/run)."
            )
        if missing:
            logger.warning(
                "Workers %s do not see the driver's temporary checkpoint directory (another "
                "node): epoch-end states come back through the driver. Set a shared "
                "checkpoint_dir so that the workers write them directly.",
                missing,
            )
        self._checkpoint_probe, self._checkpoint_shared = self._group, not missing
        return self._checkpoint_shared

    def _keep_checkpoint(self, stats: dict[str, Any], written: list[dict[str, Any]]) -> None:
        """Driver: the workers wrote (or are writing) a checkpoint; keep its path as the recovery point."""
        path = self.checkpoint_manager.record(written)
        if not any(w.get("pending") for w in written):
            self.recovery.latest = RecoveryPoint(
                self.epoch, self._epoch_step, path=written[0]["path"]
            )
        if path is not None:
            stats["checkpoint_path"] = path
        errors = [w["previous_error"] for w in written if w.get("previous_error")]
        if errors:
            logger.warning(
                "A background checkpoint write failed (it was not committed): %s", errors[0]
            )
            stats["checkpoint_error"] = errors[0]

    def _flush_checkpoints(self) -> None:
        """Driver: wait for the workers' background writes (before a planned stop), then note the commits."""
        group = self._group
        if group is None:
            return
        deadline = time.monotonic() + FLUSH_TIMEOUT_S

        def give_up() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"background writes still running after {FLUSH_TIMEOUT_S} s")

        try:
            group.get(group.execute_async(checkpoint_worker.flush), on_poll=give_up)
        except Exception as exc:  # noqa: BLE001 (a dead worker's write is lost anyway)
            logger.warning("Could not wait for background checkpoint writes: %s", exc)
        self._sync_recovery_point()

    def _sync_recovery_point(self) -> None:
        """Driver: make the newest committed directory the recovery point (a background save may have committed)."""
        if self.checkpoint_manager.latest is not None:
            return  # a state held in memory is newer than any directory
        newest = self.checkpoint_manager.restore_point()
        point = self.recovery.latest
        if newest is None or (point is not None and point.path == newest):
            return
        meta = layout.open_checkpoint(newest, framework=self.framework).meta
        self.recovery.latest = RecoveryPoint(
            int(meta["epoch"]), int(meta.get("epoch_step", 0)), path=newest
        )

    # ------------------------------------------------------------- restoring
    def _resume_if_requested(self) -> None:
        """Driver, after the first start: with ``resume=True``, load the newest committed checkpoint.

        Runs once per trainer (a later restart restores its own recovery point).
        Without a committed checkpoint in ``checkpoint_dir`` the run starts fresh.
        """
        if not getattr(self.checkpoint, "resume", False) or getattr(self, "_resumed", False):
            return
        self._resumed = True
        newest = layout.latest_committed(self.checkpoint_manager.root())
        if newest is None:
            logger.info(
                "resume=True: no committed checkpoint in %s; starting fresh.",
                self.checkpoint.checkpoint_dir,
            )
            return
        logger.info("resume=True: continuing from %s", newest)
        self.load(newest)

    def _restart(self, num_workers: int | None = None) -> None:
        """Start a fresh group from the newest committed checkpoint (see ``StateMixin._restart``).

        A planned restart (an elastic group growing back) first lets the workers
        finish their background writes.
        """
        if self._group is not None:
            self._flush_checkpoints()
        else:
            self._sync_recovery_point()
        super()._restart(num_workers)

    def _load_state_file(self, path: str) -> None:
        """Driver: a checkpoint directory is read by the workers; a file as before."""
        if layout.is_checkpoint_dir(path):
            self._load_checkpoint_dir(path)
        else:
            super()._load_state_file(path)

    def _load_checkpoint_dir(self, url: str) -> dict[str, Any]:
        """Driver: every worker loads its part of the directory; returns its ``epoch``/``epoch_step``."""
        module = self.checkpoint_worker_module
        if module is None:
            # A trainer subclass for another framework that declares no worker module.
            raise CheckpointError(
                f"{type(self).__name__} cannot read the checkpoint directory {url!r}: it sets "
                f"no checkpoint_worker_module. Load a file written by save() instead, or set "
                f"checkpoint_worker_module to a module with load_dir(url)."
            )
        return self._run(module.load_dir, url)[0]

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written under any backend or world size: a file from :meth:`save`, or a directory.

        A checkpoint directory (``checkpoint_dir``'s ``checkpoint_000003``, local or an
        fsspec URL) is validated on the driver first (commit marker, manifest, file
        sizes, framework), then every worker reads only the ranges it holds. A file
        is read with ``weights_only=True``.

        Raises:
            CheckpointError: missing, truncated, uncommitted, corrupted, not a polytrain
                checkpoint, or written by a trainer of another framework; nothing is
                loaded then.
        """
        if not layout.is_checkpoint_dir(path):
            super().load(path)
            return
        self._ensure_open()
        checkpoint = layout.open_checkpoint(os.fspath(path), framework=self.framework)
        info = self._load_checkpoint_dir(checkpoint.url)
        self.epoch, self._epoch_step = int(info["epoch"]), int(info.get("epoch_step", 0))
        self._global_step = int(checkpoint.meta.get("global_step", self._global_step))
        self.checkpoint_manager.loaded(checkpoint.url)
        if self._keeps_state:
            self.recovery.latest = RecoveryPoint(self.epoch, self._epoch_step, path=checkpoint.url)
