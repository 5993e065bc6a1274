"""Stopping Ray clusters a test starts in processes of its own.

``ray stop`` would stop every Ray instance on the machine. A test's cluster runs in
its own process group and its own session folder instead (``ray start --head
--block``, ``ray up`` of a fake cluster): it is stopped through that group and
through the processes whose command line names the folder (raylet, GCS, dashboard,
agents), and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil

#: ``ray start --block`` answers SIGTERM by stopping its children one by one with
#: long grace periods (30-40 s seen at teardown); a test's cluster holds nothing to save.
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


def stop_cluster(group: int, marker: str) -> None:
    """SIGTERM process group ``group`` and every process naming ``marker``; SIGKILL what is left.

    Waits up to :data:`GRACE_S` after each signal; returns when they are gone.
    """
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    members = []
    for pid in {*pids_using(marker), *_group_members(group)}:
        try:
            members.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for member in members:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(members, timeout=GRACE_S)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)


def stop_ray_head(proc: subprocess.Popen, temp_dir: str) -> None:
    """:func:`stop_cluster` for a head started as ``proc`` (its own session) in ``temp_dir``."""
    stop_cluster(proc.pid, temp_dir)
    try:
        proc.wait(timeout=GRACE_S)  # reaped: no zombie left behind
    except subprocess.TimeoutExpired:
        pass


def _group_members(group: int) -> list[int]:
    members = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and os.getpgid(process.pid) == group:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return members
