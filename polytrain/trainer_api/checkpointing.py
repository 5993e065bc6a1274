"""The trainer's epoch-end checkpoints: the latest state for recovery, files in checkpoint_dir."""

from __future__ import annotations

from typing import Any

from polytrain.trainer_api import checkpoint as ckpt
from polytrain.trainer_api.config import CheckpointConfig


class CheckpointManager:
    """Keeps the latest epoch-end state and writes epoch checkpoints.

    The latest state is what a restarted worker group resumes from. With
    ``checkpoint_dir`` set, every remembered state is also written (atomically)
    to ``checkpoint_epoch_XXXXXX.pt`` there, keeping the newest ``num_to_keep``.

    Args:
        config: where and how many checkpoints to keep.
        keep_latest: whether the trainer needs epoch-end states at all (retries,
            elastic training or a ``checkpoint_dir``); without it, states loaded
            by the user are not kept either.
    """

    def __init__(self, config: CheckpointConfig, keep_latest: bool) -> None:
        self.config = config
        self.keep_latest = keep_latest
        self.latest: dict[str, Any] | None = None

    def remember(self, state: dict[str, Any]) -> str | None:
        """Keep an epoch-end checkpoint dict; write it to ``checkpoint_dir`` if set.

        Returns:
            The path written, or None without ``checkpoint_dir``.
        """
        self.latest = state
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        path = ckpt.save_checkpoint(state, ckpt.epoch_checkpoint_path(directory, state["epoch"]))
        ckpt.prune_checkpoints(directory, self.config.num_to_keep)
        return str(path)

    def loaded(self, state: dict[str, Any]) -> None:
        """Note a state the user loaded: a restart must not fall back behind it."""
        if self.keep_latest:
            self.latest = state
