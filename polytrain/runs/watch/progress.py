"""The progress bar on the driver: rank 0's progress, read through the monitor channel."""

from __future__ import annotations

from typing import Any

from polytrain.launchers.base import WorkerGroup


class ProgressReporter:
    """A tqdm bar on the driver that follows rank 0's progress.

    Call :meth:`poll` regularly while the group runs (it never waits) and
    :meth:`close` once the call is over.

    Args:
        group: the running worker group.
        description: the bar's label (e.g. ``"epoch 3"``).
    """

    def __init__(self, group: WorkerGroup, description: str) -> None:
        from tqdm.auto import tqdm

        self._group = group
        self._bar = tqdm(desc=description, unit="batch", leave=True, dynamic_ncols=True)
        self._pending: Any = None

    def poll(self) -> None:
        """Show rank 0's latest answer, if it came in, and ask again."""
        if self._pending is not None:
            done, progress = self._group.poll(self._pending)
            if not done:
                return
            self._pending = None
            if progress and progress.get("phase") == "train":
                self.update(progress)
        self._pending = self._group.monitor_single_async(0, "progress")

    def update(self, progress: dict[str, Any]) -> None:
        """Move the bar to a progress record (``step``, ``total``, ``loss``)."""
        if progress.get("total") is not None and self._bar.total != progress["total"]:
            self._bar.total = progress["total"]
        self._bar.n = progress.get("step", 0)
        if progress.get("loss") is not None:
            self._bar.set_postfix(loss=f"{progress['loss']:.4f}", refresh=False)
        self._bar.refresh()

    def close(self, final: dict[str, Any] | None = None) -> None:
        """Close the bar, showing the final step count and loss of ``final`` if given."""
        if final:
            steps = final.get("num_steps")
            if steps is not None:
                self._bar.total = self._bar.total or steps
                self._bar.n = steps
            if "loss" in final:
                self._bar.set_postfix(loss=f"{final['loss']:.4f}", refresh=False)
        self._bar.close()
