"""The data position of a creator-API run: epoch, batches into it, optimizer steps so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataPosition:
    """Where a trainer's training stands; its checkpoints record and restore it.

    Attributes:
        epoch: the current epoch, counted from 0 (the number of epochs completed).
        epoch_step: batches of that epoch already trained (0 at an epoch start).
        global_step: optimizer steps over the run.
    """

    epoch: int = 0
    epoch_step: int = 0
    global_step: int = 0

    def describe(self) -> str:
        """``epoch 2, batch 40``, for log lines and errors."""
        return f"epoch {self.epoch}, batch {self.epoch_step}"
