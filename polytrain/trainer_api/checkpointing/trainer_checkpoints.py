"""A trainer's checkpoints on the driver: request them, keep recovery points, restore, save, load.

:class:`TrainerCheckpoints` is the object a :class:`~polytrain.trainer_api.trainer.BaseTrainer`
holds (``trainer.checkpoints``). The workers write every checkpoint directory themselves
(:mod:`polytrain.trainer_api.checkpointing.worker_writer`); the driver receives the
directory's path and a few numbers per rank, never a tensor. A restart after a lost
worker, an elastic resize and :meth:`TrainerCheckpoints.load` of a directory have the
new workers read it, each only the ranges it holds. Consolidated files
(:meth:`TrainerCheckpoints.save`) and in-memory states (a driver-node fallback) go
through the portable format of :mod:`polytrain.checkpoint.single_file`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import SaveRequest
from polytrain.errors import CheckpointError, ConfigError
from polytrain.runs.loop import RunLoop
from polytrain.trainer_api.checkpointing import worker_writer as checkpoint_worker
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.checkpointing.recovery import RecoveryPoint, RecoveryStore
from polytrain.trainer_api.data.position import DataPosition
from polytrain.trainer_api.options.configs import CheckpointConfig

logger = logging.getLogger(__name__)

#: How long a planned stop (shutdown, elastic resize) waits for background checkpoint writes.
FLUSH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class WorkerStates:
    """How a framework's training state leaves and enters the workers (the trainer's hooks).

    Attributes:
        framework: ``torch`` or ``tensorflow`` (recorded in every checkpoint).
        backend_name: the backend in use (recorded in every checkpoint).
        worker_module: the framework's worker-side checkpoint module (``save_dir``,
            ``load_dir``), or None: checkpoint directories cannot be read.
        gather: the consolidated state from the workers (before it is wrapped).
        scatter: load a validated checkpoint dict into every worker.
        for_file: a state as :meth:`TrainerCheckpoints.save` writes it.
    """

    framework: str
    backend_name: str
    worker_module: Any
    gather: Callable[[], dict[str, Any]]
    scatter: Callable[[dict[str, Any]], None]
    for_file: Callable[[dict[str, Any]], dict[str, Any]]


class TrainerCheckpoints:
    """The checkpoints of one trainer (driver side).

    Args:
        loop: the trainer's run loop (its group, and calls into it).
        states: how the framework's state leaves and enters the workers.
        position: the trainer's data position (read for requests, set by loads).
        manager: names, tracks and prunes the checkpoint directories.
        recovery: the latest state a restarted group resumes from.
        config: the trainer's checkpoint options.
        max_failures: ``failure_config.max_checkpoint_failures``.
        keeps_state: whether the trainer keeps recovery states now (retries on,
            elastic training or a ``checkpoint_dir``).
    """

    def __init__(
        self,
        *,
        loop: RunLoop,
        states: WorkerStates,
        position: DataPosition,
        manager: CheckpointManager,
        recovery: RecoveryStore,
        config: CheckpointConfig,
        max_failures: int,
        keeps_state: Callable[[], bool],
    ) -> None:
        self.loop = loop
        self.states = states
        self.position = position
        self.manager = manager
        self.recovery = recovery
        self.config = config
        self.max_failures = max_failures
        self.keeps_state = keeps_state
        self._probed_group: Any = None  # the group asked whether it sees the directory
        self._shared = False
        self._resumed = False
        self._failed_writes = 0  # checkpoint writes failed in a row

    def header(self, epoch: int) -> dict[str, Any]:
        """What a checkpoint's manifest records about the run (``epoch``: epochs completed)."""
        return {
            "framework": self.states.framework,
            "backend": self.states.backend_name,
            "world_size": self.loop.group_size,
            "epoch": int(epoch),
            "global_step": int(self.position.global_step),
        }

    def request(self, epoch: int, epoch_step: int = 0) -> SaveRequest:
        """Driver: a fresh checkpoint directory for the state at ``(epoch, epoch_step)``."""
        return self.manager.request(
            self.header(epoch),
            step_in_epoch=epoch_step or None,
            epoch_step=int(epoch_step),
        )

    def workers_see_directory(self) -> bool:
        """Driver: whether every worker of the group sees the checkpoint directory (asked once per group).

        Without a ``checkpoint_dir`` the directory is a temporary one on the driver's
        node: workers on other nodes do not see it, and the state then comes back
        through the driver instead (as a consolidated dict).

        Raises:
            ConfigError: a ``checkpoint_dir`` that some worker does not see.
        """
        if self.loop.scaling.local_mode:
            return True
        if self._probed_group is self.loop.group:
            return self._shared
        root = self.manager.root()
        name = f".polytrain-probe-{uuid.uuid4().hex}"
        root.write_bytes(name, b"")
        try:
            seen = self.loop.call(checkpoint_worker.sees, root.url, name)
        finally:
            root.remove(name)
        missing = [rank for rank, ok in enumerate(seen) if not ok]
        if missing and self.config.checkpoint_dir is not None:
            raise ConfigError(
                f"checkpoint_dir={self.config.checkpoint_dir!r} is not visible from worker "
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
        self._probed_group, self._shared = self.loop.group, not missing
        return self._shared

    def keep_directory(self, stats: dict[str, Any], written: list[dict[str, Any]]) -> bool:
        """Driver: the workers wrote (or are writing) a checkpoint; keep its path as the recovery point.

        A write that failed on some rank (disk full, permission lost, a store that
        errors) is dropped: the directory is removed (it was never committed), the
        previous checkpoint stays the recovery point, ``stats["checkpoint_error"]``
        names the path and the cause, and a warning says so. Training goes on until
        ``failure_config.max_checkpoint_failures`` writes in a row failed.

        Returns:
            Whether the checkpoint was written (or is being written in the background).

        Raises:
            CheckpointError: ``max_checkpoint_failures`` consecutive writes failed.
        """
        errors = [w["previous_error"] for w in written if w.get("previous_error")]
        if errors:
            self._write_failed(stats, written[0].get("previous_path") or "", errors[0], False)
        failed = [w["error"] for w in written if w.get("error")]
        if failed:
            self._write_failed(stats, written[0]["path"], failed[0], True)
            return False
        if not errors:
            self._failed_writes = 0
        path = self.manager.record(written)
        if not any(w.get("pending") for w in written):
            self.recovery.latest = RecoveryPoint(
                self.position.epoch, self.position.epoch_step, path=written[0]["path"]
            )
        if path is not None:
            stats["checkpoint_path"] = path
        return True

    def _write_failed(self, stats: dict[str, Any], url: str, error: str, remove: bool) -> None:
        """Count a failed checkpoint write, log it, drop its directory; raise past the limit."""
        self._failed_writes += 1
        limit = self.max_failures
        previous = self.manager.latest_path
        stats["checkpoint_error"] = error
        if remove and url:
            try:  # frees the space a full disk needs for the next write
                self.manager.root().child(url.rsplit("/", 1)[-1]).remove()
            except OSError as exc:
                logger.warning("Could not remove the uncommitted checkpoint %s: %s", url, exc)
        message = (
            f"Checkpoint {url or '(background write)'} was not written ({error}); it is not "
            f"committed and never loaded. The previous checkpoint stays the one to resume "
            f"from: {previous or 'none yet'}. Failed writes in a row: {self._failed_writes} of "
            f"failure_config.max_checkpoint_failures={limit}."
        )
        if self._failed_writes >= limit:
            raise CheckpointError(
                f"{message} Training stops: free space or fix the storage's permissions, "
                f"then resume (resume=True, or load() the previous checkpoint)."
            )
        logger.warning("%s Training continues.", message)

    def keep_state(
        self, stats: dict[str, Any], state: dict[str, Any] | None, path: str | None
    ) -> None:
        """Keep the epoch-end state a call captured (a dict, or a file rank 0 wrote)."""
        if path is not None and not os.path.isfile(path):
            state, path = self.states.gather(), None  # written on another node: fetch it
        if path is not None:
            written = self.recovery.remember_file(path, self.position.epoch)
        elif state is not None:
            written = self.recovery.remember_state(self.wrap_state(state))
        else:
            return
        if written is not None:
            stats["checkpoint_path"] = written

    def flush(self) -> None:
        """Driver: wait for the workers' background writes (before a planned stop), then note the commits."""
        group = self.loop.group
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
        self.sync_recovery_point()

    def sync_recovery_point(self) -> None:
        """Driver: make the newest committed directory the recovery point (a background save may have committed)."""
        if self.manager.latest is not None:
            return  # a state held in memory is newer than any directory
        newest = self.manager.restore_point()
        point = self.recovery.latest
        if newest is None or (point is not None and point.path == newest):
            return
        meta = layout.open_checkpoint(newest, framework=self.states.framework).meta
        self.recovery.latest = RecoveryPoint(
            int(meta["epoch"]), int(meta.get("epoch_step", 0)), path=newest
        )

    def checkpoint_here(self) -> str | None:
        """Driver: a committed checkpoint at the current data position; its path (None: the write failed).

        Waits for background writes first; when the newest committed checkpoint is
        already at the position (the call ended where one was due) it is the one,
        else the workers write one now (``checkpoint_worker_module.save_dir``).
        """
        position = self.position
        self.flush()
        point = self.recovery.latest
        if (
            point is not None
            and point.path
            and self.recovery.is_at(position.epoch, position.epoch_step)
        ):
            return point.path
        written = self.loop.call(
            self.states.worker_module.save_dir,
            self.request(position.epoch, position.epoch_step),
        )
        stats: dict[str, Any] = {}
        if not self.keep_directory(stats, written):
            return None
        self.flush()  # an asynchronous save commits in the background
        point = self.recovery.latest
        return point.path if point is not None else None

    def resume_if_requested(self) -> None:
        """Driver, after the first start: with ``resume=True``, load the newest committed checkpoint.

        Runs once per trainer (a later restart restores its own recovery point).
        A newer checkpoint that is uncommitted (an interrupted save) or damaged (a
        truncated rank file) is skipped with a warning naming it; without a loadable
        checkpoint in ``checkpoint_dir`` the run starts fresh.
        """
        if not getattr(self.config, "resume", False) or self._resumed:
            return
        self._resumed = True
        found, skipped = layout.newest_loadable(self.manager.root(), self.states.framework)
        for url, reason in skipped:
            logger.warning("resume=True: skipping checkpoint %s: %s", url, reason)
        newest = found.url if found is not None else None
        if newest is None:
            logger.info(
                "resume=True: no committed checkpoint in %s; starting fresh.",
                self.config.checkpoint_dir,
            )
            return
        logger.info("resume=True: continuing from %s", newest)
        self.load(newest)

    def load_recovery_file(self, path: str) -> None:
        """Driver: load a recovery point's checkpoint into every worker (a directory: each reads its part)."""
        if layout.is_checkpoint_dir(path):
            self.load_directory(path)
        else:
            self.states.scatter(ckpt.load_checkpoint(path, framework=self.states.framework))

    def load_directory(self, url: str) -> dict[str, Any]:
        """Driver: every worker loads its part of the directory; returns its ``epoch``/``epoch_step``."""
        module = self.states.worker_module
        if module is None:
            # A trainer subclass for another framework that declares no worker module.
            raise CheckpointError(
                f"{type(self).__name__} cannot read the checkpoint directory {url!r}: it sets "
                f"no checkpoint_worker_module. Load a file written by save() instead, or set "
                f"checkpoint_worker_module to a module with load_dir(url)."
            )
        return self.loop.call(module.load_dir, url)[0]

    def wrap_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The portable checkpoint envelope around a framework state (see :mod:`.checkpoint`)."""
        return {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "framework": self.states.framework,
            "backend": self.states.backend_name,
            "world_size": self.loop.scaling.world_size,
            "epoch": self.position.epoch,
            "epoch_step": self.position.epoch_step,
            **state,
        }

    def state_dict(self) -> dict[str, Any]:
        """The consolidated training state as a portable checkpoint dict."""
        return self.wrap_state(self.states.gather())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or :meth:`load` on every worker.

        Any backend of the same framework and any world size may have written it.

        Raises:
            CheckpointError: not a checkpoint dict of this framework; nothing is loaded.
        """
        self.loop.ensure_open()
        ckpt.validate_checkpoint(state, "state", framework=self.states.framework)
        self.states.scatter(state)
        self.position.epoch = int(state["epoch"])
        self.position.epoch_step = int(state.get("epoch_step", 0))
        # A restart must not fall back behind a loaded checkpoint.
        self.recovery.loaded(state, keep=self.keeps_state())

    def save(self, path: str | os.PathLike) -> str:
        """Write a consolidated checkpoint to ``path`` atomically; returns the absolute path."""
        return str(ckpt.save_checkpoint(self.states.for_file(self.state_dict()), path))

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
        self.loop.ensure_open()
        if not layout.is_checkpoint_dir(path):
            self.load_state_dict(ckpt.load_checkpoint(path, framework=self.states.framework))
            return
        checkpoint = layout.open_checkpoint(os.fspath(path), framework=self.states.framework)
        info = self.load_directory(checkpoint.url)
        position = self.position
        position.epoch, position.epoch_step = int(info["epoch"]), int(info.get("epoch_step", 0))
        position.global_step = int(checkpoint.meta.get("global_step", position.global_step))
        self.manager.loaded(checkpoint.url)
        if self.keeps_state():
            self.recovery.latest = RecoveryPoint(
                position.epoch, position.epoch_step, path=checkpoint.url
            )
