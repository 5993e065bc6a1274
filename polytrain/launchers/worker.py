"""The worker process: a stateless executor of functions, plus a monitor channel.

Functions sent to a worker keep what they build in :data:`WORKER_STATE`, a
per-process dict, so the executor itself holds no training state. Training calls
run on the actor's default thread (always the same thread: CUDA's current
device and some frameworks are per-thread); the ``monitor`` concurrency group
answers progress, output and stack-dump requests while that thread is busy or stuck.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from polytrain.compat import quiet
from polytrain.launchers.pool import reset as worker_reset
from polytrain.launchers.ranks import WorkerMetadata

logger = logging.getLogger(__name__)

#: Per-process state shared by the functions a worker executes (e.g. the operator).
WORKER_STATE: dict[str, Any] = {}

#: The :data:`WORKER_STATE` key of the function that answers :meth:`Worker.stop_request`.
STOP_HANDLER = "stop_handler"

_training_thread: int | None = None  # ident of the thread that runs ``execute``
_progress_lock = threading.Lock()
_progress: dict[str, Any] = {"phase": "idle", "step": 0, "total": None, "updated": time.time()}
_output_lock = threading.Lock()
_output: list[tuple[str, str]] = []  # lines for the driver (see emit_output)

#: Wall-clock marks of this process's start (``actor_init``, ``preload_done``) and the
#: seconds each pre-imported module took (``import:<name>``): the cold-start profile.
STARTUP: dict[str, float] = {}


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


def clear_progress() -> None:
    """Forget every progress record: the worker is idle at step 0 (a reused worker)."""
    with _progress_lock:
        _progress.clear()
        _progress.update({"phase": "idle", "step": 0, "total": None, "updated": time.time()})


def read_progress() -> dict[str, Any]:
    """A copy of this worker's latest progress record."""
    with _progress_lock:
        return dict(_progress)


def emit_output(line: str, stream: str = "stdout") -> None:
    """Queue a line of output (a child process's) for the driver to print on ``stream``.

    The driver takes the queue with the monitor call :meth:`Worker.output`: lines
    reach its console as they are, with no Ray log prefix and no deduplication.
    """
    with _output_lock:
        _output.append((stream, line))


def take_output() -> list[tuple[str, str]]:
    """Every queued ``(stream, line)``, oldest first; the queue is empty afterwards."""
    with _output_lock:
        lines = _output[:]
        _output.clear()
    return lines


def find_free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock.getsockname()[1]


def preload_modules(modules: Sequence[str]) -> None:
    """Import ``modules`` in order, recording the seconds each takes in :data:`STARTUP`.

    A module that fails to import is skipped (the code that needs it reports the
    error with its own context).
    """
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by whoever really needs the module
            logger.debug("pre-import of %s failed", name, exc_info=True)
            continue
        STARTUP[f"import:{name}"] = time.perf_counter() - start
    worker_reset.note_torch_threads()
    gc.collect()
    gc.freeze()  # library objects live as long as the process: collections need not scan them
    STARTUP["preload_done"] = time.time()


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
    """A worker process (made a Ray actor by the worker group).

    Args:
        env_vars: environment variables set on top of the process's own.
        niceness: CPU priority to take (Ray starts workers at a lower one).
        preload: modules to import in a background thread right away (torch, the
            backend's libraries), overlapping the driver's remaining set-up. Calls to
            :meth:`execute` wait for it: imports never run on two threads at once.
    """

    def __init__(
        self,
        env_vars: dict[str, str] | None = None,
        niceness: int | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        STARTUP["actor_init"] = time.time()
        worker_reset.record_start_state()
        self._reuse_blocker: str | None = None
        os.environ.update(env_vars or {})
        # Third-party noise (DeepSpeed notices, torch deprecations raised inside
        # frameworks) stays out of the driver's console unless POLYTRAIN_VERBOSE=1.
        quiet.install()
        if niceness is not None:
            # Ray starts workers at a lower CPU priority than the driver; a training
            # worker should compete on equal terms with a torchrun process.
            try:
                os.setpriority(os.PRIO_PROCESS, 0, niceness)
            except OSError:
                pass
        faulthandler.enable()
        self._preload: threading.Thread | None = None
        if preload:
            self._preload = threading.Thread(
                target=preload_modules,
                args=(tuple(preload),),
                name="polytrain-preload",
                daemon=True,
            )
            self._preload.start()

    def _wait_for_preload(self) -> None:
        if self._preload is not None:
            self._preload.join()
            self._preload = None

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in this process and return its result."""
        global _training_thread
        self._wait_for_preload()
        _training_thread = threading.get_ident()
        return fn(*args, **kwargs)

    # Warm pool: release and reuse (see polytrain.launchers.pool.warm_pool).
    def reset(self) -> str | None:
        """Return this process to its start state for the next group; None when reusable.

        See :mod:`polytrain.launchers.pool.reset` for what is undone. Returns why the
        process cannot be reused instead (the pool then stops it).
        """
        self._wait_for_preload()
        self._reuse_blocker = worker_reset.reset_process(WORKER_STATE)
        clear_progress()
        take_output()
        return self._reuse_blocker

    def reuse(self, env_vars: dict[str, str] | None = None) -> WorkerMetadata | None:
        """Take this reset process into a new group: set its environment; return its metadata.

        Returns None when the last :meth:`reset` found the process unfit for reuse.
        """
        if self._reuse_blocker is not None:
            return None
        os.environ.update(env_vars or {})
        return self.metadata()

    def startup_timings(self) -> dict[str, float]:
        """:data:`STARTUP`: when this process started, and its pre-imports' durations."""
        return dict(STARTUP)

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

    def output(self) -> list[tuple[str, str]]:
        """Output lines queued by :func:`emit_output` since the last call."""
        return take_output()

    def stacks(self) -> str:
        """Every Python thread's stack: where a stuck worker is stuck."""
        return format_all_stacks()

    def stop_request(self, request: Any) -> Any:
        """Hand a request to stop the running call to its handler; None without one.

        The function that runs the call installs the handler as
        ``WORKER_STATE[STOP_HANDLER]``; it answers here, from the monitor thread,
        while the training thread keeps running.
        """
        handler = WORKER_STATE.get(STOP_HANDLER)
        return handler(request) if handler is not None else None

    def ping(self) -> int:
        """Liveness check; returns the pid."""
        return os.getpid()
