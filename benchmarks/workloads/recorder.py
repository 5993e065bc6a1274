"""What every benchmark process records: step times, phase marks and resident memory.

The native scripts, the polytrain and Ray Train workers and the Lightning callback
all record with the process's :data:`RECORDER` (a :class:`StepRecorder`) and write
it with :func:`write_summary` as ``rank<r>.json``, which the runner reads back:
per-step times, the wall-clock time of the first completed step, and the
process's resident memory (the whole run's peak, the set-up peak, the baseline
right before the model was built).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any


# ------------------------------------------------------------------ memory
def current_rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (``ru_maxrss``), in MiB.

    After :meth:`StepRecorder.setup_done` reset the high-water mark, this is the peak
    since then; :meth:`StepRecorder.summary` reports the maximum of both.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hwm_rss_mb() -> float | None:
    """The resident high-water mark (``VmHWM`` of /proc/self/status), in MiB; None if absent."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reset_hwm() -> bool:
    """Reset the resident high-water mark to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------- recorder
class StepRecorder:
    """Per-process timing and memory record, written as JSON at the end of a run.

    ``marks`` are wall-clock (``time.time()``) timestamps of named phases, so the
    orchestrator can subtract its own launch timestamp; step durations use
    ``time.perf_counter()``.
    """

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.step_s: list[float] = []
        self.ends: list[float] = []
        self.baseline_rss_mb: float | None = None
        self.setup_peak_rss_mb: float | None = None
        self.setup_rss_mb: float | None = None
        self.hwm_reset = False

    def mark(self, name: str) -> None:
        """Record the wall-clock time of a named phase (the first call per name wins)."""
        self.marks.setdefault(name, time.time())

    def before_model(self) -> None:
        """Call right before the model is built: the baseline of the memory delta."""
        if self.baseline_rss_mb is None:
            self.baseline_rss_mb = current_rss_mb()
        self.mark("model_build")

    def setup_done(self) -> None:
        """Call after the model is wrapped, before the first step: the set-up peak.

        Records the high-water mark so far (model build, broadcast, sharding) and resets
        it, so that the peak at the end of the run is the training peak alone.
        """
        if self.setup_peak_rss_mb is not None:
            return
        self.setup_peak_rss_mb = hwm_rss_mb() or peak_rss_mb()
        self.setup_rss_mb = current_rss_mb()
        self.hwm_reset = reset_hwm()
        self.mark("setup_done")

    def record(self, start: float, end: float) -> None:
        """Record one step that ran from ``start`` to ``end`` (``perf_counter`` values)."""
        self.step_s.append(end - start)
        self.ends.append(end)
        if len(self.step_s) == 1:
            self.mark("first_step")

    def restart_steps(self) -> None:
        """Forget the steps recorded so far (the marks stay): the steady state starts now."""
        self.step_s.clear()
        self.ends.clear()

    def summary(self, rank: int) -> dict[str, Any]:
        """Everything recorded, plus the process's peak memory and scheduling facts."""
        torch = sys.modules.get("torch")  # not imported just to ask (TensorFlow runs)
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        train_peak = (hwm_rss_mb() or peak_rss_mb()) if self.hwm_reset else None
        return {
            "rank": rank,
            "pid": os.getpid(),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "torch_threads": torch.get_num_threads() if torch is not None else None,
            "python_threads": threading.active_count(),
            "marks": self.marks,
            "step_s": self.step_s,
            # End of step i-1 to end of step i: includes data loading and loop overhead.
            "interval_s": intervals,
            "baseline_rss_mb": self.baseline_rss_mb,
            # ru_maxrss follows the reset of setup_done(): the whole run's peak is the larger.
            "peak_rss_mb": max(peak_rss_mb(), self.setup_peak_rss_mb or 0.0, train_peak or 0.0),
            "setup_peak_rss_mb": self.setup_peak_rss_mb,
            "setup_rss_mb": self.setup_rss_mb,
            "train_peak_rss_mb": train_peak,
            "final_rss_mb": current_rss_mb(),
        }


#: The recorder of this process (native scripts, and polytrain / Ray Train workers).
RECORDER = StepRecorder()


def write_summary(result_dir: str | os.PathLike, rank: int, extra: dict | None = None) -> None:
    """Write this process's summary to ``result_dir/rank{rank}.json``."""
    data = RECORDER.summary(rank)
    data.update(extra or {})
    path = Path(result_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(data))
