"""The report board: where every rank's ``report`` meets, checkpoints commit and get pruned.

One board per ``fit()``, a Ray actor (no CPU) the workers call from ``report``, or
a plain object in local mode. A step's checkpoint directory is committed (its
``COMMITTED`` marker written last, after ``.polytrain_metrics.json``) when every
rank of the group has reported that step and at least one passed a checkpoint:
all ranks have copied their files by then, since each reports after its copy.
The board keeps rank 0's metrics of every step, across restarts of the group.

Checkpoints are kept as Ray Train keeps them (``CheckpointConfig``): ranked by
``checkpoint_score_attribute`` (a ``/`` path into nested metrics), a NaN score below
every number and a missing one below every number too (Ray's order: NaN, missing,
numbers; ties by report order), the worst deleted first beyond ``num_to_keep``,
never the latest one nor one whose validation is pending.

It is also where a drain reaches the loop consistently: the driver posts a
:class:`~polytrain.train.preemption.PreemptionInfo` (:meth:`ReportBoard.announce_preemption`),
which the board hands out from the first report number no rank has made yet, so
every rank gets the same answer from the same ``report()`` call; from then on a
rank learns whether its step committed a checkpoint (:meth:`ReportBoard.step_done`),
the step every rank stops at. And the ranks meet here for ``polytrain.train.collective``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint.storage import Storage
from polytrain.errors import ConfigError
from polytrain.train.checkpoint import REPORT_FILE
from polytrain.train.config import CheckpointConfig
from polytrain.train.preemption import PreemptionInfo

logger = logging.getLogger(__name__)

METRICS_FILE = ".polytrain_metrics.json"
COMMITTED = "COMMITTED"
PENDING_VALIDATION = "PENDING_VALIDATION"


def flat_get(metrics: dict[str, Any], attribute: str) -> Any:
    """``metrics[attribute]``, where ``a/b`` also reaches ``metrics["a"]["b"]`` (Ray's flattening).

    Raises:
        KeyError: no such metric.
    """
    if attribute in metrics:
        return metrics[attribute]
    head, sep, rest = attribute.partition("/")
    while sep:
        value = metrics.get(head)
        if isinstance(value, dict):
            try:
                return flat_get(value, rest)
            except KeyError:
                pass
        part, sep, rest = rest.partition("/")
        head = f"{head}/{part}"
    raise KeyError(attribute)


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
        self._pending: dict[int, dict[int, tuple[Any, ...]]] = {}
        #: Local mode only (the board is a plain object): called after every new history entry.
        self.listener: Any = None
        self._reported_upto = -1  # the highest report number any rank of this attempt made
        # (first report number, info) of each announcement of this attempt, oldest first.
        self._announced: list[tuple[int, PreemptionInfo]] = []
        # The announced steps every rank has reported: whether each committed a checkpoint.
        self._done: dict[int, bool] = {}
        self._collectives: dict[int, dict[str, Any]] = {}
        self.return_value: Any = None
        # (index, metrics) of every kept checkpoint, oldest first; their directory names
        # and validation status by index.
        self.committed: list[tuple[int, dict[str, Any]]] = []
        self.names: dict[int, str] = {}
        self.status: dict[int, str] = {}
        self.kinds: dict[int, str] = {}  # the reported Checkpoint subclass, where not the base
        self._latest: int | None = None
        for index, name in self._scan():
            self.committed.append((index, self._read_metrics(name)))
            self.names[index] = name
            self.status[index] = COMMITTED
        if self.committed:
            self._latest = self.committed[-1][0]

    # ---------------------------------------------------------------- storage
    def _scan(self) -> list[tuple[int, str]]:
        """``(index, name)`` of the committed checkpoint directories of the run, by index."""
        found = {}
        for name in self.root.listdir():
            order = layout.parse_name(name)
            child = self.root.child(name)
            index = self._index_of(child) if order is None else order[0]
            if index is not None and layout.is_committed(child):
                found[index] = name
        return sorted(found.items())

    @staticmethod
    def _index_of(child: Storage) -> int | None:
        try:
            return int(json.loads(child.read_bytes(REPORT_FILE))["index"])
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, KeyError):
            return None

    def _read_metrics(self, name: str) -> dict[str, Any]:
        try:
            return json.loads(self.root.child(name).read_bytes(METRICS_FILE))
        except (FileNotFoundError, ValueError):
            return {}

    def _write_metrics(self, index: int, metrics: dict[str, Any]) -> None:
        target = self.root.child(self.names[index])
        target.write_bytes(METRICS_FILE, json.dumps(metrics, default=repr).encode())

    def new_attempt(self, world_size: int) -> int:
        """Driver: a (re)started group of ``world_size``; returns the first free step index.

        Reports of a dead attempt that not every rank made are dropped, and their
        uncommitted directories deleted.
        """
        self.world_size = world_size
        self._pending.clear()
        done = {index for index, _ in self.committed}
        kept = set(self.names.values())
        # The dead attempt's workers are gone (the group is torn down before a restart):
        # nothing writes into these any more.
        for name in self.root.listdir():
            if name in kept:
                continue
            order = layout.parse_name(name)
            if order is not None:
                if order[0] not in done:
                    self.root.remove(name)
            elif self._index_of(self.root.child(name)) is not None:
                self.root.remove(name)  # a custom-named directory of an unfinished report
        seen = [entry["_index"] for entry in self.history]
        start = max([*done, *seen, -1 if self._latest is None else self._latest], default=-1) + 1
        # A new group runs off any node that drained under the old one: nothing to announce.
        self._reported_upto = start - 1
        self._announced.clear()
        self._done.clear()
        self._collectives.clear()
        return start

    # ---------------------------------------------------------------- drains
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

    # ---------------------------------------------------------------- reports
    def report(
        self,
        index: int,
        rank: int,
        metrics: Any,
        has_checkpoint: bool,
        name: str | None = None,
        validation: Any = False,
        kind: str | None = None,
    ) -> tuple[PreemptionInfo | None, bool | None]:
        """Worker ``rank`` reported step ``index``.

        Args:
            index: the report's number.
            rank: the reporting rank.
            metrics: its metrics (rank 0's are the step's).
            has_checkpoint: whether it copied checkpoint files into the step's directory.
            name: that directory's name (None: ``checkpoint_NNNNNN``).
            validation: the validation it asks for (False: none).
            kind: the reported checkpoint's class (``module:qualname``; None: ``Checkpoint``).

        Returns:
            ``(info, done)``: the drain announced for this report number (None: none),
            and, when this report completed an announced step, whether a checkpoint was
            committed at it (None: other ranks have not reported it yet, or nothing was
            announced; ask :meth:`step_done`).

        Raises:
            ConfigError: the ranks put the step's checkpoint under different names.
        """
        self._reported_upto = max(self._reported_upto, index)
        info = self.preemption_at(index)
        pending = self._pending.setdefault(index, {})
        pending[rank] = (metrics, has_checkpoint, name, validation, kind)
        if len(pending) < self.world_size:
            return info, None
        del self._pending[index]
        checkpoint_url = self._complete(index, pending)
        if info is not None:
            self._done[index] = checkpoint_url is not None
        if self.listener is not None:
            self.listener()
        return info, self._done.get(index)

    def _complete(self, index: int, pending: dict[int, tuple[Any, ...]]) -> str | None:
        """Every rank reported step ``index``: commit its checkpoint (if any), add the history entry."""
        metrics = dict(pending.get(0, ({},))[0] or {})
        worker_metrics = [pending[r][0] if r in pending else None for r in range(self.world_size)]
        writers = [entry for entry in pending.values() if entry[1]]
        checkpoint_url = None
        validation = False
        if writers:
            names = {entry[2] or layout.checkpoint_name(index) for entry in writers}
            if len(names) > 1:
                raise ConfigError(
                    f"report {index}: the ranks put their checkpoint files under different "
                    f"checkpoint_dir_name values {sorted(names)}; every rank must pass the same "
                    f"name at a step."
                )
            asked = [entry[3] for _, entry in sorted(pending.items()) if entry[3]]
            validation = asked[0] if asked else False
            kinds = [entry[4] for entry in writers if entry[4]]
            if kinds:
                self.kinds[index] = kinds[0]
            checkpoint_url = self._commit(index, metrics, names.pop(), validation)
        self.history.append(
            {
                **metrics,
                "_index": index,
                "_timestamp": time.time(),
                "_checkpoint": checkpoint_url,
                "_worker_metrics": worker_metrics,
                "_validation": validation,
                "_checkpoint_kind": self.kinds.get(index) if checkpoint_url else None,
            }
        )
        return checkpoint_url

    def _commit(self, index: int, metrics: dict[str, Any], name: str, validation: Any) -> str:
        # A name used again replaces the checkpoint it named (its files were overwritten).
        for old, old_name in list(self.names.items()):
            if old_name == name:
                self._forget(old)
        self.names[index] = name
        self.status[index] = PENDING_VALIDATION if validation else COMMITTED
        self._write_metrics(index, metrics)
        self.root.child(name).write_bytes(layout.MARKER, b"")  # last: the checkpoint is whole
        self.committed.append((index, metrics))
        self._latest = index
        self._prune()
        return self.root.url_of(name)

    def _forget(self, index: int) -> None:
        self.committed = [entry for entry in self.committed if entry[0] != index]
        self.names.pop(index, None)
        self.status.pop(index, None)
        self.kinds.pop(index, None)

    def validation_done(self, index: int, metrics: dict[str, Any], status: str) -> None:
        """Driver: the validation of step ``index``'s checkpoint ended (``status``: Ray's name).

        A validated checkpoint's metrics are updated with the validation's, so it ranks
        by them; one that timed out or failed keeps its training metrics.
        """
        if index not in self.names:
            return  # released meanwhile (Tune keeps its own copy)
        self.status[index] = status
        if metrics:
            position = next(i for i, entry in enumerate(self.committed) if entry[0] == index)
            merged = {**self.committed[position][1], **metrics}
            self.committed[position] = (index, merged)
            self._write_metrics(index, merged)
        self._prune()

    # ---------------------------------------------------------------- retention
    def ranked(self) -> list[tuple[int, dict[str, Any]]]:
        """The kept checkpoints worst first (Ray's order; by report order without a score)."""
        if self.config.checkpoint_score_attribute is None:
            return list(self.committed)
        return sorted(self.committed, key=self._score)

    def best(self) -> list[tuple[int, dict[str, Any]]]:
        """Ray Train's ``best_checkpoints``: the ``num_to_keep`` best, worst first (all without a limit)."""
        ranked = self.ranked()
        keep = self.config.num_to_keep
        return ranked if keep is None else ranked[-keep:]

    def _prune(self) -> None:
        keep = self.config.num_to_keep
        if keep is None or len(self.committed) <= keep:
            return
        spared = {self._latest} | {i for i, s in self.status.items() if s == PENDING_VALIDATION}
        doomed = {index for index, _ in self.ranked()[:-keep]} - spared
        for index in sorted(doomed):
            self.root.remove(self.names[index])
            self._forget(index)

    def _score(self, entry: tuple[int, dict[str, Any]]) -> tuple[bool, float, int]:
        index, metrics = entry
        attribute = self.config.checkpoint_score_attribute
        try:
            value = flat_get(metrics, attribute)
        except KeyError:
            logger.error(
                "Checkpoint %d has no metric %r to rank it by (checkpoint_score_attribute); its "
                "metrics are %s. It ranks below every scored checkpoint.",
                index,
                attribute,
                sorted(metrics),
            )
            return (True, -math.inf, index)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            logger.error(
                "Checkpoint %d's %r is %r, not a number: it ranks below every scored checkpoint.",
                index,
                attribute,
                value,
            )
            return (True, -math.inf, index)
        if math.isnan(value):
            return (False, -math.inf, index)  # NaN below everything: dropped first
        return (True, value if self.config.checkpoint_score_order == "max" else -value, index)

    # ------------------------------------------------------------- reads
    def snapshot(self) -> dict[str, Any]:
        """Driver: the history, the kept checkpoints (URL, metrics) oldest first, the best, the rest."""
        return {
            "history": list(self.history),
            "committed": [(self.root.url_of(self.names[i]), m) for i, m in self.committed],
            "best": [(self.root.url_of(self.names[i]), m) for i, m in self.best()],
            "latest": self.latest_checkpoint(),
            "return_value": self.return_value,
            "kinds": {self.root.url_of(self.names[i]): k for i, k in self.kinds.items()},
        }

    def entries_since(self, count: int) -> list[dict[str, Any]]:
        """Driver: the history entries after the first ``count`` (what a poll has not seen)."""
        return self.history[count:]

    def reported_checkpoints(self, upto: int, validated: bool) -> list[tuple] | None:
        """Worker: the kept checkpoints ``(url, metrics, status, kind)`` in Ray's order, once ready.

        Ready: every report up to number ``upto`` is complete (all ranks made it), and
        with ``validated`` no validation is pending. None: not yet.
        """
        if any(index <= upto for index in self._pending):
            return None
        if validated and PENDING_VALIDATION in self.status.values():
            return None
        return [
            (self.root.url_of(self.names[i]), dict(m), self.status[i], self.kinds.get(i))
            for i, m in self.ranked()
        ]

    def release_before(self, index: int) -> None:
        """Delete the committed checkpoints older than step ``index`` (another store holds copies)."""
        for i in [i for i, _ in self.committed if i < index]:
            self.root.remove(self.names[i])
            self._forget(i)

    def latest_checkpoint(self) -> str | None:
        """The URL of the newest committed checkpoint, or None."""
        if self._latest is None or self._latest not in self.names:
            return None
        return self.root.url_of(self.names[self._latest])

    def set_return_value(self, value: Any) -> None:
        """Worker (rank 0): what the loop returned (``Result.return_value``)."""
        self.return_value = value

    # ---------------------------------------------------------------- collectives
    def collective(self, seq: int, rank: int, payload: Any) -> tuple[bool, Any]:
        """Worker: rank ``rank`` arrived at collective number ``seq``; ``(ready, rank 0's payload)``."""
        state = self._collectives.setdefault(seq, {"arrived": {}, "taken": set()})
        state["arrived"][rank] = payload
        return self.collective_result(seq, rank)

    def collective_result(self, seq: int, rank: int) -> tuple[bool, Any]:
        """Worker: whether every rank has arrived at collective ``seq``, and rank 0's payload."""
        state = self._collectives.get(seq)
        if state is None or len(state["arrived"]) < self.world_size:
            return False, None
        value = state["arrived"].get(0)
        state["taken"].add(rank)
        if len(state["taken"]) >= self.world_size:
            del self._collectives[seq]
        return True, value
