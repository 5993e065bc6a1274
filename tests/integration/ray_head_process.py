"""Stopping a Ray head a test started with ``ray start --head --block`` in its own temp dir.

``ray stop`` would stop every Ray instance on the machine. The head runs in its own
process group and session folder instead: the group is signalled, then any process
whose command line names the folder (raylet, GCS, dashboard, agents).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil

#: ``ray start --block`` answers SIGTERM by stopping its children one by one with
#: long grace periods (30-40 s seen at teardown); a test's head holds nothing to save.
GRACE_S = 5


def pids_using(marker: str) -> list[int]:
    """Processes (other than this one) whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def stop_ray_head(proc: subprocess.Popen, temp_dir: str) -> None:
    """Stop the head's process group and every process of its session; wait until gone."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=GRACE_S)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=GRACE_S)
    left = []
    for pid in pids_using(temp_dir):
        try:
            left.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for member in left:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)
