"""The hang watchdog: turns a group that stopped making progress into a WorkerHangError."""

from __future__ import annotations

import time
from typing import Any

from polytrain.errors import WorkerHangError
from polytrain.launchers.base import WorkerGroup


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
        stacks = self._group.monitor("stacks", timeout_s=10.0)
        progress = self._group.monitor("progress", timeout_s=5.0)
        steps = [p.get("step", -1) if isinstance(p, dict) else -1 for p in progress]
        frames = [_innermost_frame(s) if isinstance(s, str) else "" for s in stacks]
        # The stuck rank: furthest behind, and among equals one whose training thread
        # sits in user code rather than waiting inside a library (a collective).
        slowest = min(range(len(steps)), key=lambda r: (steps[r], _is_library_frame(frames[r]), r))
        lines = [
            f"No worker made progress for {self._timeout_s:g}s (hang_timeout_s); the group is "
            f"torn down. Stuck: rank {slowest} (step {steps[slowest]}, at {frames[slowest]}). "
            f"Per rank:"
        ]
        dump = []
        for rank, (record, stack) in enumerate(zip(progress, stacks, strict=True)):
            where = _innermost_frame(stack) if isinstance(stack, str) else f"no answer ({stack!r})"
            state = record if isinstance(record, dict) else {}
            lines.append(
                f"  rank {rank}: phase {state.get('phase')}, epoch {state.get('epoch')}, step "
                f"{state.get('step')}, stuck at {where}"
            )
            dump.append(f"--- rank {rank} ---\n{stack}")
        return WorkerHangError("\n".join(lines), rank=slowest, remote_traceback="\n".join(dump))


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
