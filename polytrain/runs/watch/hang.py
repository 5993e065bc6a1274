"""The hang watchdog: turns a group that stopped making progress into a WorkerHangError."""

from __future__ import annotations

import time
from typing import Any

from polytrain.errors import WorkerHangError
from polytrain.launchers.base import WorkerGroup

#: A progress probe unanswered this long marks its worker as stopped or frozen: the
#: monitor thread answers within milliseconds even while training is stuck.
SILENT_AFTER_S = 5.0
#: How long the hang report waits for the stacks and progress of the ranks that answer.
REPORT_WAIT_S = 10.0


class HangWatchdog:
    """Raises :class:`WorkerHangError` when no worker reports progress for ``timeout_s``.

    Progress is read through the workers' monitor channel, which answers from its
    own thread while the training thread is blocked, so even a worker stuck in a
    collective can say where it is stuck. Call :meth:`poll` regularly while the
    group runs (it never waits).

    Args:
        group: the running worker group.
        timeout_s: seconds without any worker's progress that count as a hang.
    """

    def __init__(self, group: WorkerGroup, timeout_s: float) -> None:
        self._group = group
        self._timeout_s = timeout_s
        self._pending: list[Any] | None = None
        self._pending_since = 0.0
        self._answers: dict[int, Any] = {}
        self._last: list[Any] = [None] * len(group)
        self._last_change = time.monotonic()

    def poll(self) -> None:
        """Read the progress asked for last time, if every worker answered; ask again.

        Raises:
            WorkerHangError: no progress for ``timeout_s``; names the stuck rank and
                carries every worker's stack.
        """
        if self._pending is not None:
            self._collect()
        if time.monotonic() - self._last_change > self._timeout_s:
            raise self._hang_error()
        if self._pending is None:
            self._pending = [
                self._group.monitor_single_async(rank, "progress")
                for rank in range(len(self._group))
            ]
            self._pending_since = time.monotonic()
            self._answers = {}

    def _collect(self) -> None:
        """Take the answers that came in; once all did, note whether anything moved."""
        for rank, ref in enumerate(self._pending or []):
            if rank not in self._answers:
                done, record = self._group.poll(ref)
                if done:
                    self._answers[rank] = record
        if len(self._answers) < len(self._pending or []):
            return
        keys = [_progress_key(self._answers[rank]) for rank in range(len(self._answers))]
        if keys != self._last:
            self._last = keys
            self._last_change = time.monotonic()
        self._pending = None

    def _hang_error(self) -> WorkerHangError:
        silent = self._silent_ranks()
        stacks, progress = self._ask_every_rank(skip=silent)
        silent |= {rank for rank, stack in enumerate(stacks) if stack is None}
        last_known = [
            dict(zip(("phase", "epoch", "step"), key or (), strict=False)) for key in self._last
        ]
        records = [
            progress[rank] if isinstance(progress[rank], dict) else last_known[rank]
            for rank in range(len(stacks))
        ]
        steps = [
            record.get("step", -1) if record.get("step") is not None else -1 for record in records
        ]
        frames = [_innermost_frame(s) if isinstance(s, str) else "" for s in stacks]
        if silent:
            # A process that cannot even answer from its monitor thread is the cause;
            # its peers merely wait for it inside a collective.
            slowest = min(silent)
            seen = records[slowest].get("step")
            where = _SILENT if seen is None else f"{_SILENT}; last seen at step {seen}"
        else:
            # The stuck rank: furthest behind, and among equals one whose training thread
            # sits in user code rather than waiting inside a library (a collective).
            slowest = min(
                range(len(steps)), key=lambda r: (steps[r], _is_library_frame(frames[r]), r)
            )
            where = f"step {steps[slowest]}, at {frames[slowest]}"
        lines = [
            f"No worker made progress for {self._timeout_s:g}s (hang_timeout_s); the group is "
            f"torn down. Stuck: rank {slowest} ({where}). Per rank:"
        ]
        dump = []
        for rank, (record, stack) in enumerate(zip(records, stacks, strict=True)):
            at = (
                _SILENT
                if rank in silent
                else _innermost_frame(stack)
                if isinstance(stack, str)
                else f"no answer ({stack!r})"
            )
            lines.append(
                f"  rank {rank}: phase {record.get('phase')}, epoch {record.get('epoch')}, step "
                f"{record.get('step')}, stuck at {at}"
            )
            dump.append(f"--- rank {rank} ---\n{stack if stack is not None else _SILENT}")
        return WorkerHangError("\n".join(lines), rank=slowest, remote_traceback="\n".join(dump))

    def _silent_ranks(self) -> set[int]:
        """The ranks whose progress probe has gone unanswered for :data:`SILENT_AFTER_S`."""
        if self._pending is None or time.monotonic() - self._pending_since < SILENT_AFTER_S:
            return set()
        return {rank for rank in range(len(self._pending)) if rank not in self._answers}

    def _ask_every_rank(self, skip: set[int]) -> tuple[list[Any], list[Any]]:
        """Every rank's stacks and progress, asked at once; None where no answer came in time.

        Ranks in ``skip`` are known not to answer and are not waited for, so a
        stopped process costs no wait at all, and the others at most :data:`REPORT_WAIT_S`.
        """
        ranks = [rank for rank in range(len(self._group)) if rank not in skip]
        refs = {
            (method, rank): self._group.monitor_single_async(rank, method)
            for method in ("stacks", "progress")
            for rank in ranks
        }
        answers: dict[tuple[str, int], Any] = {}
        deadline = time.monotonic() + REPORT_WAIT_S
        while len(answers) < len(refs) and time.monotonic() < deadline:
            for key, ref in refs.items():
                if key not in answers:
                    done, value = self._group.poll(ref)
                    if done:
                        answers[key] = value
            if len(answers) < len(refs):
                time.sleep(0.05)
        size = len(self._group)
        stacks = [answers.get(("stacks", rank)) for rank in range(size)]
        progress = [answers.get(("progress", rank)) for rank in range(size)]
        return stacks, progress


_SILENT = "no answer: its process is stopped or frozen"


def _progress_key(record: Any) -> Any:
    if not isinstance(record, dict):
        return None
    return (record.get("phase"), record.get("epoch"), record.get("step"))


def _is_library_frame(frame: str) -> bool:
    return "site-packages" in frame or "/polytrain/" in frame or not frame


def _innermost_frame(stack: str) -> str:
    """The last ``File ..., line ..., in ...`` line of the first (training) thread's stack."""
    first_thread = stack.split("\n\n")[0]
    frames = [
        line.strip() for line in first_thread.splitlines() if line.strip().startswith("File ")
    ]
    return frames[-1] if frames else "(no Python frame)"
