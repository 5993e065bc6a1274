"""Two jobs that take turns: the native torchrun script and polytrain, alive together.

Runs one after the other cannot resolve a 3 % difference on this kind of machine: the
same runner's median moves by up to 17 % between runs minutes apart (RESULTS.md). In
the turns mode both jobs are set up side by side and then train in alternating
windows of a few steps, one job at a time, the other one idle: N0 P0 N1 P1 ... Each
polytrain window is compared with the native windows right before and after it, so
a drift of the machine's speed over minutes hits both sides of every ratio.

The protocol is a counter in a file of a shared directory (written atomically).
Turn ``t`` belongs to the native job when even and to polytrain when odd; window
``w`` of a job is turn ``2 w`` or ``2 w + 1``. Every rank of a job polls the counter
until its turn comes (a sleep between reads: an idle job takes no CPU from the
working one), the ranks meet at a barrier, run the window's steps and meet again;
rank 0 appends the window's time to the job's record and hands the turn over. Before
it waits, every rank gives its allocator's free heap back to the system
(:func:`release_heap`): the 8 ranks of the 355M model otherwise keep about 22 of a
24 GiB machine's memory resident and Ray's memory monitor stops the run. Both jobs
do it, so each window starts from a trimmed heap on either side. After
its last window a job waits for the end (turn ``2 W``) before it tears down, so that
neither job's exit runs during the other's window.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import time
from pathlib import Path

JOBS = ("native", "polytrain")
POLL_S = 0.02


class Turns:
    """One job's side of the turn counter in ``directory``."""

    def __init__(self, directory: str | os.PathLike, job: str, windows: int) -> None:
        if job not in JOBS:
            raise ValueError(f"job must be one of {JOBS}, got {job!r}")
        self.directory = Path(directory)
        self.job = job
        self.windows = windows

    @property
    def end(self) -> int:
        """The turn after both jobs' last windows."""
        return 2 * self.windows

    def turn_of(self, window: int) -> int:
        """The counter value at which this job runs ``window``."""
        return 2 * window + JOBS.index(self.job)

    def current(self) -> int:
        """The counter (0 before anyone wrote it)."""
        try:
            return int((self.directory / "turn").read_text())
        except (FileNotFoundError, ValueError):  # not yet written, or caught mid-rename
            return 0

    def wait_for(self, turn: int, timeout_s: float = 3600) -> None:
        """Block until the counter reaches ``turn``."""
        deadline = time.monotonic() + timeout_s
        while self.current() < turn:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.job}: turn {turn} did not come in {timeout_s} s")
            time.sleep(POLL_S)

    def hand_over(
        self, window: int, seconds: float, steps: int, faults: list[int] | None = None
    ) -> None:
        """Rank 0 after ``window``: record its time (and each rank's page faults), hand over."""
        record = {"job": self.job, "window": window, "s": seconds, "steps": steps}
        if faults is not None:
            record["faults"] = faults
        with open(self.directory / f"{self.job}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
        partial = self.directory / "turn.tmp"
        partial.write_text(str(self.turn_of(window) + 1))
        os.replace(partial, self.directory / "turn")

    def mark_ready(self) -> None:
        """Say that this job's setup is done (the driver starts the other job's then)."""
        (self.directory / f"{self.job}.ready").write_text("1")


def release_heap() -> None:
    """Give glibc's free heap pages back to the system (no live tensor changes).

    What ``polytrain.compat.allocator.release_free_memory`` does; written out here
    because the native script must not import polytrain.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def page_faults() -> int:
    """This process's minor page faults so far (fresh pages the kernel had to zero and map)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gather_faults(since: int) -> list[int]:
    """(every rank, collective) Each rank's page faults since ``since``, in rank order."""
    import torch.distributed as dist

    counts: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(counts, page_faults() - since)
    return counts


def _records(directory: str | os.PathLike, job: str) -> list[dict]:
    """What :meth:`Turns.hand_over` recorded for ``job``, in window order."""
    path = Path(directory) / f"{job}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["window"])


def read_faults(directory: str | os.PathLike, job: str) -> list[list[int]]:
    """A job's page faults per window and rank, in window order (empty where not recorded)."""
    return [r.get("faults", []) for r in _records(directory, job)]


def read_windows(directory: str | os.PathLike, job: str) -> list[float]:
    """A job's recorded window times, in window order (seconds per step)."""
    return [r["s"] / r["steps"] for r in _records(directory, job)]


def sandwich_ratios(native: list[float], polytrain: list[float], skip: int = 1) -> list[float]:
    """polytrain's window over the mean of the native windows on either side of it.

    The order is N0 P0 N1 P1 ...: P_w sits between N_w and N_(w+1); the last one has
    only N_w before it. The first ``skip`` windows of each job are warm-up (the other
    job may still have been setting up during N0) and are left out.
    """
    ratios = []
    for w in range(skip, len(polytrain)):
        around = native[w : w + 2]
        if around:
            ratios.append(polytrain[w] / (sum(around) / len(around)))
    return ratios
