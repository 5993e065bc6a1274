"""The training position, recovery points and checkpoints of a trainer (driver side).

:class:`StateMixin` is the part of :class:`~polytrain.trainer_api.trainer.BaseTrainer`
that moves the data position after every training call, keeps the state a restart
resumes from (see :mod:`polytrain.trainer_api.checkpointing.recovery`), restores it, and saves
and loads checkpoints.

The data position is ``(epoch, epoch_step)``: the epoch the next batch belongs to
(epochs count from 0, so it is also the number of epochs completed) and how many
of its batches were trained already. ``train(num_steps=N)`` moves it by N batches;
an epoch ends when the workers' loader is exhausted.
"""

from __future__ import annotations

import os
from typing import Any

from polytrain.checkpoint import single_file as ckpt
from polytrain.trainer_api.options.configs import check_int


class StateMixin:
    """Position, recovery and checkpoints; mixed into ``BaseTrainer`` (which provides the attributes)."""

    epoch: int
    _epoch_step: int
    _global_step: int

    def _restart(self, num_workers: int | None = None) -> None:
        """Start a fresh group and restore the latest recovery point into it.

        ``num_workers`` None: the :class:`ScalingPolicy` sizes the group (with
        ``min_workers``, as many workers as the cluster holds now). Without a
        recovery point the new workers start from the creators, at epoch 0.
        """
        self._teardown_group()
        self._group_size = num_workers or self.scaling_policy.restart_size()
        self._start()
        point = self.recovery.latest
        if point is None:
            self.epoch = self._epoch_step = 0
        elif point.state is not None:
            self.load_state_dict(point.state)
        else:
            self._load_state_file(point.path)
            self.epoch, self._epoch_step = point.epoch, point.epoch_step

    def _load_state_file(self, path: str) -> None:
        """Driver: load a checkpoint file on the driver's node into every worker."""
        self._load_worker_state(ckpt.load_checkpoint(path, framework=self.framework))

    def _begin_call(self, max_retries: int | None = None) -> None:
        """Before a training call: note a per-call retry wish; at an epoch start, grow a shrunk group back."""
        self._ensure_open()
        if max_retries is not None:
            check_int("max_retries", max_retries, 0)
            if max_retries > 0 and not self._keeps_state:
                # From now on epoch ends keep a state; until the first one, restart from here.
                self._retries_requested = True
                if self.recovery.latest is None and (self.epoch or self._epoch_step):
                    self.recovery.remember_state(self.state_dict())
        if (
            self._epoch_step == 0
            and self.recovery.is_at(self.epoch, 0)
            and self.scaling_policy.should_grow(self._group_size)
        ):
            self._restart(self.scaling.num_workers)

    def _end_call(self, stats: dict[str, Any], cursor: dict[str, Any]) -> dict[str, Any]:
        """After a training call: move the data position, add restart and size stats."""
        if cursor["epoch_done"]:
            self.epoch, self._epoch_step = cursor["epoch"] + 1, 0
        else:
            self.epoch, self._epoch_step = cursor["epoch"], cursor["position"]
        self._global_step += int(stats.get("num_steps", 0) or 0)
        stats["epoch"] = cursor["epoch"]
        stats["num_restarts"] = self.num_restarts
        stats["num_workers"] = self.num_workers
        return stats

    def _keep_state(
        self, stats: dict[str, Any], state: dict[str, Any] | None, path: str | None
    ) -> None:
        """Keep the epoch-end state a call captured (a dict, or a file rank 0 wrote)."""
        if path is not None and not os.path.isfile(path):
            state, path = self._worker_state(), None  # written on another node: fetch it
        if path is not None:
            written = self.recovery.remember_file(path, self.epoch)
        elif state is not None:
            written = self.recovery.remember_state(self._wrap_state(state))
        else:
            return
        if written is not None:
            stats["checkpoint_path"] = written

    # ----------------------------------------------------------- checkpoints
    def _wrap_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The portable checkpoint envelope around a framework state (see :mod:`.checkpoint`)."""
        return {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "framework": self.framework,
            "backend": self.backend.name,
            "world_size": self.scaling.world_size,
            "epoch": self.epoch,
            "epoch_step": self._epoch_step,
            **state,
        }

    def state_dict(self) -> dict[str, Any]:
        """The consolidated training state as a portable checkpoint dict."""
        return self._wrap_state(self._worker_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or :meth:`load` on every worker.

        Any backend of the same framework and any world size may have written it.

        Raises:
            CheckpointError: not a checkpoint dict of this framework; nothing is loaded.
        """
        self._ensure_open()
        ckpt.validate_checkpoint(state, "state", framework=self.framework)
        self._load_worker_state(state)
        self.epoch = int(state["epoch"])
        self._epoch_step = int(state.get("epoch_step", 0))
        # A restart must not fall back behind a loaded checkpoint.
        self.recovery.loaded(state, keep=self._keeps_state)

    def save(self, path: str | os.PathLike) -> str:
        """Write a consolidated checkpoint to ``path`` atomically; returns the absolute path."""
        return str(ckpt.save_checkpoint(self._file_state(self.state_dict()), path))

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by :meth:`save` under any backend or world size.

        The file is read with ``weights_only=True`` and validated before anything
        changes.

        Raises:
            CheckpointError: the file is missing, corrupted, not a polytrain checkpoint
                or written by a trainer of another framework; nothing is loaded then.
        """
        self._ensure_open()
        self.load_state_dict(ckpt.load_checkpoint(path, framework=self.framework))
