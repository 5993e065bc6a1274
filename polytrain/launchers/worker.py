"""The worker process: a stateless executor of functions, plus a monitor channel.

Functions sent to a worker keep what they build in :data:`WORKER_STATE`, a
per-process dict, so the executor itself holds no training state. Training calls
run on the actor's default thread (always the same thread: CUDA's current
device and some frameworks are per-thread); the ``monitor`` concurrency group
answers progress and stack-dump requests while that thread is busy or stuck.
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from polytrain.launchers.ranks import WorkerMetadata

#: Per-process state shared by the functions a worker executes (e.g. the operator).
WORKER_STATE: dict[str, Any] = {}

_training_thread: int | None = None  # ident of the thread that runs ``execute``
_progress_lock = threading.Lock()
_progress: dict[str, Any] = {"phase": "idle", "step": 0, "total": None, "updated": time.time()}


def report_progress(
    step: int, total: int | None = None, phase: str = "train", **metrics: Any
) -> None:
    """Record this worker's progress; the driver reads it without interrupting training."""
    with _progress_lock:
        _progress.update(metrics)
        _progress["phase"] = phase
        _progress["step"] = step
        _progress["total"] = total
        _progress["updated"] = time.time()


def read_progress() -> dict[str, Any]:
    """A copy of this worker's latest progress record."""
    with _progress_lock:
        return dict(_progress)


def find_free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock.getsockname()[1]


def format_all_stacks() -> str:
    """Every Python thread's stack in this process, the training thread first.

    Threads are separated by a blank line; each starts with a ``Thread NAME:`` line.
    """
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = io.StringIO()
    for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != _training_thread):
        if ident == threading.get_ident():
            continue  # the thread answering this request
        label = "training thread" if ident == _training_thread else names.get(ident, ident)
        out.write(f"Thread {label}:\n")
        out.write("".join(traceback.format_stack(frame)).replace("\n\n", "\n"))
        out.write("\n")
    return out.getvalue()


class Worker:
    """A worker process (made a Ray actor by the worker group)."""

    def __init__(self, env_vars: dict[str, str] | None = None, niceness: int | None = None) -> None:
        os.environ.update(env_vars or {})
        if niceness is not None:
            # Ray starts workers at a lower CPU priority than the driver; a training
            # worker should compete on equal terms with a torchrun process.
            try:
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
            except OSError:
                pass
        faulthandler.enable()

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in this process and return its result."""
        global _training_thread
        _training_thread = threading.get_ident()
        return fn(*args, **kwargs)

    def metadata(self) -> WorkerMetadata:
        """Where this worker runs."""
        import ray

        try:
            gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        except Exception:  # noqa: BLE001 - outside Ray (local mode) there are none
            gpu_ids = ()
        ctx = ray.get_runtime_context()
        return WorkerMetadata(
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=gpu_ids,
        )

    def set_env_vars(self, env_vars: dict[str, str]) -> None:
        """Set environment variables in this process."""
        os.environ.update(env_vars)

    def free_port(self) -> int:
        """A free TCP port on this worker's host."""
        return find_free_port()

    # Monitor channel: answered from another thread while ``execute`` runs.
    def progress(self) -> dict[str, Any]:
        """This worker's latest progress record."""
        return read_progress()

    def stacks(self) -> str:
        """Every Python thread's stack: where a stuck worker is stuck."""
        return format_all_stacks()

    def ping(self) -> int:
        """Liveness check; returns the pid."""
        return os.getpid()
