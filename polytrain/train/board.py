"""The report board: where every rank's ``report`` meets, checkpoints commit and get pruned.

One board per ``fit()``, a Ray actor (no CPU) the workers call from ``report``, or
a plain object in local mode. A step's checkpoint directory is committed (its
``COMMITTED`` marker written last, after ``.polytrain_metrics.json``) when every
rank of the group has reported that step and at least one passed a checkpoint:
all ranks have copied their files by then, since each reports after its copy.
The board keeps rank 0's metrics of every step, across restarts of the group.

It is also where a drain reaches the loop consistently: the driver posts a
:class:`~polytrain.train.preemption.PreemptionInfo` (:meth:`ReportBoard.announce_preemption`),
which the board hands out from the first report number no rank has made yet, so
every rank gets the same answer from the same ``report()`` call; from then on a
rank learns whether its step committed a checkpoint (:meth:`ReportBoard.step_done`),
the step every rank stops at.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint.storage import Storage
from polytrain.train.config import CheckpointConfig
from polytrain.train.preemption import PreemptionInfo

METRICS_FILE = ".polytrain_metrics.json"


class ReportBoard:
    """Collects the reports of one run (driver-owned; workers call :meth:`report`).

    Args:
        run_url: the run's directory (local path or fsspec URL).
        checkpoint_config: retention.
    """

    def __init__(self, run_url: str, checkpoint_config: CheckpointConfig) -> None:
        self.root = Storage(run_url)
        self.config = checkpoint_config
        self.world_size = 1
        self.history: list[dict[str, Any]] = []
        self._pending: dict[int, dict[int, tuple[Any, bool]]] = {}
        #: Local mode only (the board is a plain object): called after every new history entry.
        self.listener: Any = None
        self._reported_upto = -1  # the highest report number any rank of this attempt made
        # (first report number, info) of each announcement of this attempt, oldest first.
        self._announced: list[tuple[int, PreemptionInfo]] = []
        # The announced steps every rank has reported: whether each committed a checkpoint.
        self._done: dict[int, bool] = {}
        # (index, metrics) of every committed checkpoint, oldest first.
        self.committed: list[tuple[int, dict[str, Any]]] = [
            (order[0], self._read_metrics(name))
            for order, name in layout.list_checkpoint_dirs(self.root)
            if layout.is_committed(self.root.child(name))
        ]

    def _read_metrics(self, name: str) -> dict[str, Any]:
        try:
            return json.loads(self.root.child(name).read_bytes(METRICS_FILE))
        except (FileNotFoundError, ValueError):
            return {}

    def new_attempt(self, world_size: int) -> int:
        """Driver: a (re)started group of ``world_size``; returns the first free step index.

        Reports of a dead attempt that not every rank made are dropped, and their
        uncommitted directories deleted.
        """
        self.world_size = world_size
        self._pending.clear()
        done = {index for index, _ in self.committed}
        # The dead attempt's workers are gone (the group is torn down before a restart):
        # nothing writes into these any more.
        for order, name in layout.list_checkpoint_dirs(self.root):
            if order[0] not in done:
                self.root.remove(name)
        seen = [entry["_index"] for entry in self.history]
        start = max([*done, *seen], default=-1) + 1
        # A new group runs off any node that drained under the old one: nothing to announce.
        self._reported_upto = start - 1
        self._announced.clear()
        self._done.clear()
        return start

    def announce_preemption(self, info: PreemptionInfo) -> int:
        """Driver: a node of the group drains; returns the first report number that carries ``info``.

        That is the number after the highest any rank has reported: no rank has had an
        answer for it yet, so every rank gets ``info`` from the same ``report()`` call.
        """
        first = self._reported_upto + 1
        self._announced.append((first, info))
        return first

    def preemption_at(self, index: int) -> PreemptionInfo | None:
        """The drain announced for report number ``index`` (the newest that applies), or None."""
        found = None
        for first, info in self._announced:
            if first <= index:
                found = info
        return found

    def step_done(self, index: int) -> bool | None:
        """Worker: for an announced step, whether it committed a checkpoint; None: not every rank reported it."""
        return self._done.get(index)

    def report(
        self, index: int, rank: int, metrics: Any, has_checkpoint: bool
    ) -> tuple[PreemptionInfo | None, bool | None]:
        """Worker ``rank`` reported step ``index`` (metrics: rank 0's, else None).

        Returns:
            ``(info, done)``: the drain announced for this report number (None: none),
            and, when this report completed an announced step, whether a checkpoint was
            committed at it (None: other ranks have not reported it yet, or nothing was
            announced; ask :meth:`step_done`).
        """
        self._reported_upto = max(self._reported_upto, index)
        info = self.preemption_at(index)
        pending = self._pending.setdefault(index, {})
        pending[rank] = (metrics, has_checkpoint)
        if len(pending) < self.world_size:
            return info, None
        del self._pending[index]
        metrics = dict(pending.get(0, ({}, False))[0] or {})
        checkpoint_url = None
        if any(has for _, has in pending.values()):
            checkpoint_url = self._commit(index, metrics)
        self.history.append(
            {**metrics, "_index": index, "_timestamp": time.time(), "_checkpoint": checkpoint_url}
        )
        if info is not None:
            self._done[index] = checkpoint_url is not None
        if self.listener is not None:
            self.listener()
        return info, self._done.get(index)

    def _commit(self, index: int, metrics: dict[str, Any]) -> str:
        name = layout.checkpoint_name(index)
        target = self.root.child(name)
        target.write_bytes(METRICS_FILE, json.dumps(metrics, default=repr).encode())
        target.write_bytes(layout.MARKER, b"")  # last: the checkpoint is whole
        self.committed.append((index, metrics))
        self._prune()
        return self.root.url_of(name)

    def _prune(self) -> None:
        keep = self.config.num_to_keep
        if keep is None or len(self.committed) <= keep:
            return
        latest = self.committed[-1][0]
        ranked = sorted(self.committed, key=self._score)  # worst first
        doomed = {index for index, _ in ranked[: len(ranked) - keep]} - {latest}
        for index in sorted(doomed):
            self.root.remove(layout.checkpoint_name(index))
        self.committed = [entry for entry in self.committed if entry[0] not in doomed]

    def _score(self, entry: tuple[int, dict[str, Any]]) -> tuple[float, int]:
        index, metrics = entry
        attribute = self.config.checkpoint_score_attribute
        if attribute is None:
            return (0.0, index)
        value = metrics.get(attribute)
        if not isinstance(value, (int, float)) or math.isnan(value):
            return (-math.inf, index)  # unscored checkpoints go first
        return (value if self.config.checkpoint_score_order == "max" else -value, index)

    # ------------------------------------------------------------- driver reads
    def snapshot(self) -> dict[str, Any]:
        """Driver: the history and the committed checkpoints (URL, metrics), oldest first."""
        return {
            "history": list(self.history),
            "committed": [
                (self.root.url_of(layout.checkpoint_name(i)), m) for i, m in self.committed
            ],
        }

    def entries_since(self, count: int) -> list[dict[str, Any]]:
        """Driver: the history entries after the first ``count`` (what a poll has not seen)."""
        return self.history[count:]

    def release_before(self, index: int) -> None:
        """Delete the committed checkpoints older than step ``index`` (another store holds copies)."""
        doomed = [i for i, _ in self.committed if i < index]
        for i in doomed:
            self.root.remove(layout.checkpoint_name(i))
        self.committed = [entry for entry in self.committed if entry[0] >= index]

    def latest_checkpoint(self) -> str | None:
        """The URL of the newest committed checkpoint, or None."""
        if not self.committed:
            return None
        return self.root.url_of(layout.checkpoint_name(self.committed[-1][0]))
