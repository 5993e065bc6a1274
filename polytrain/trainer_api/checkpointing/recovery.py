"""The state a restarted worker group resumes from (driver side).

With fault tolerance on (``max_retries > 0``, the default), elastic training or a
``checkpoint_dir``, every ``train()`` call that ends an epoch (and, with
``every_n_steps``/``every_s``, a call that ends where a mid-epoch checkpoint is
due) leaves a recovery point:

* normally a checkpoint directory the workers wrote themselves (e.g.
  ``checkpoint_000003/`` after 3 epochs, ``checkpoint_000003.00000040/`` 40
  batches into the 4th); the driver keeps only its path
  (:mod:`polytrain.trainer_api.checkpointing.trainer_checkpoints`);
* when some worker cannot see that directory (a multi-node run without a shared
  ``checkpoint_dir``), a consolidated state instead: rank 0 writes it to a file
  when it runs on the driver's node (``checkpoint_epoch_000003.pt`` in
  ``checkpoint_dir``, else ``recovery_000003.pt`` in a temporary directory of the
  trainer's own, deleted at shutdown), otherwise it comes back through the driver
  (Ray's object store) and stays in its memory.

A restart loads the latest point: a directory or file every new worker sees is
read by the workers themselves; otherwise the driver reads it and shares it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.checkpoint import single_file as ckpt
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.options.configs import CheckpointConfig

_RECOVERY_GLOB = "recovery_*.pt"


@dataclass
class RecoveryPoint:
    """A training state to restart from: a checkpoint dict in memory, or a checkpoint file.

    Attributes:
        epoch: the epoch the state resumes in.
        epoch_step: batches of that epoch already trained (0 at an epoch end).
        state: the checkpoint dict, held by the driver.
        path: or the checkpoint file rank 0 wrote on the driver's node.
    """

    epoch: int
    epoch_step: int = 0
    state: dict[str, Any] | None = None
    path: str | None = None


class RecoveryStore:
    """Keeps the latest :class:`RecoveryPoint` and names the file for the next one.

    Args:
        config: the trainer's checkpoint options.
        manager: the trainer's :class:`CheckpointManager` (writes and prunes the files
            of states that come back through the driver).
    """

    def __init__(self, config: CheckpointConfig, manager: CheckpointManager) -> None:
        self.config = config
        self.manager = manager
        self.latest: RecoveryPoint | None = None
        self._tmpdir: str | None = None
        self._cleanup: weakref.finalize | None = None

    def target(self, epoch: int) -> str:
        """The file rank 0 writes the state that resumes in ``epoch`` to (its directory exists)."""
        if self.config.checkpoint_dir is not None:
            path = ckpt.epoch_checkpoint_path(self.config.checkpoint_dir, epoch).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            return str(path)
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="polytrain-recovery-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        return os.path.join(self._tmpdir, f"recovery_{epoch:06d}.pt")

    def remember_file(self, path: str, epoch: int) -> str | None:
        """Rank 0 wrote the state resuming in ``epoch`` to ``path``; returns it if in ``checkpoint_dir``."""
        self.latest = RecoveryPoint(epoch, path=path)
        self.manager.latest = None  # the driver holds no tensors
        if self.config.checkpoint_dir is not None:
            ckpt.prune_checkpoints(self.config.checkpoint_dir, self.config.num_to_keep)
            return path
        for old in Path(path).parent.glob(_RECOVERY_GLOB):
            if str(old) != path:
                old.unlink(missing_ok=True)
        return None

    def remember_state(self, state: dict[str, Any]) -> str | None:
        """Keep a checkpoint dict that came through the driver; returns the file written, if any."""
        path = self.manager.remember(state)
        self.latest = RecoveryPoint(int(state["epoch"]), int(state.get("epoch_step", 0)), state)
        return path

    def loaded(self, state: dict[str, Any], keep: bool) -> None:
        """The user loaded ``state``: a restart must not fall back behind it."""
        self.manager.loaded(state)
        if keep:
            self.latest = RecoveryPoint(int(state["epoch"]), int(state.get("epoch_step", 0)), state)

    def is_at(self, epoch: int, epoch_step: int) -> bool:
        """Whether the latest point is the state at ``(epoch, epoch_step)``."""
        point = self.latest
        return point is not None and (point.epoch, point.epoch_step) == (epoch, epoch_step)

    def close(self) -> None:
        """Delete the temporary directory (the recovery files of this trainer)."""
        if self._cleanup is not None:
            self._cleanup()
