"""Return a worker process to the state it started in, so a warm pool can hand it to a new group.

:func:`record_start_state` runs when a :class:`~polytrain.launchers.worker.Worker`
starts (before the group's environment is applied); :func:`reset_process` runs
when its group is released to the warm pool (:mod:`polytrain.launchers.pool.warm_pool`).
What a reset undoes, in order:

- functions registered with :func:`register_reset_hook`: a backend's own per-process
  clean-up, registered by its worker side when it creates that state (Horovod's
  ``hvd.shutdown()``, DeepSpeed's cached sub-groups of the destroyed world), and a
  user's (``polytrain.pool.register_reset_hook``);
- every ``torch.distributed`` process group;
- ``WORKER_STATE`` (the operator, models, loaders...), then (after the steps below)
  a garbage collection and ``torch.cuda.empty_cache()``, so no tensor or CUDA
  memory survives; the objects left are frozen (:func:`gc.freeze`: libraries'
  objects, which later collections need not scan);
- the global RNGs of torch, Python and NumPy, re-seeded non-deterministically as
  in a new process (a seed set by the previous group does not carry over); torch's
  default dtype, grad mode and thread count;
- the environment variables, the working directory and ``sys.path`` of the start;
- modules imported since the start from outside the Python installation (the
  user's own modules), so the next group imports the current version of the code.
  Libraries (anything under the interpreter's prefixes or site-packages: torch,
  the backends, Ray) and polytrain itself stay imported: that is the point of a warm
  worker.

A process that imported TensorFlow is never reused: TensorFlow's collective ops
(MultiWorkerMirroredStrategy) can be configured once per process.

This module names no backend and imports no framework at module level; it reaches
torch through :data:`sys.modules` only when it was imported already.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import site
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Modules whose presence makes a process unfit for reuse, and why.
NOT_REUSABLE = {
    "tensorflow": "TensorFlow's collective ops can be configured only once per process",
}

_reset_hooks: list[Callable[[], None]] = []


@dataclass
class StartState:
    """What a worker process looked like when it started."""

    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    modules: frozenset[str]
    torch_threads: int | None = None
    notes: list[str] = field(default_factory=list)


_start: StartState | None = None


def record_start_state() -> StartState:
    """Remember this process's environment, directory, path and modules (once per process)."""
    global _start
    if _start is None:
        _start = StartState(
            env=dict(os.environ),
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            modules=frozenset(sys.modules),
        )
    return _start


def note_torch_threads() -> None:
    """Remember torch's thread count at start (called once torch is imported)."""
    torch = sys.modules.get("torch")
    if _start is not None and torch is not None and _start.torch_threads is None:
        _start.torch_threads = torch.get_num_threads()


def register_reset_hook(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in this process whenever it is reset for reuse (a library's own clean-up).

    Hooks run first, before process groups are destroyed; an exception in one makes
    the process unfit for reuse (it is stopped instead).
    """
    if hook not in _reset_hooks:
        _reset_hooks.append(hook)


def reuse_blocker() -> str | None:
    """Why this process must not be reused, or None."""
    for module, reason in NOT_REUSABLE.items():
        if module in sys.modules:
            return f"{module} was imported ({reason})"
    return None


def reset_process(worker_state: dict[str, Any]) -> str | None:
    """Undo what the previous group left in this process; None when it is fit for reuse.

    Returns the reason the process cannot be reused instead (it is then stopped).
    """
    blocker = reuse_blocker()
    if blocker is not None:
        return blocker
    try:
        for hook in list(_reset_hooks):
            hook()
        _shutdown_communication()
        worker_state.clear()
        _restore_process_state()
        purge_user_modules()
        gc.collect()  # the previous group's objects, the purged modules and their globals
        _reset_torch()
        _reset_python_rngs()
        # What survives is long-lived (libraries, their caches): later collections skip it.
        gc.freeze()
    except Exception as exc:  # noqa: BLE001 - any failure: do not reuse this process
        logger.warning("Worker reset failed; the worker is stopped instead", exc_info=True)
        return f"reset failed: {type(exc).__name__}: {exc}"
    return None


def _shutdown_communication() -> None:
    """Every torch.distributed process group (after the hooks: backends' groups go first)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _reset_torch() -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    torch.seed()  # a non-deterministic seed (CPU and CUDA), as a new process starts with
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if _start is not None and _start.torch_threads is not None:
        torch.set_num_threads(_start.torch_threads)


def _reset_python_rngs() -> None:
    random.seed()  # from the OS, as a new interpreter does
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _restore_process_state() -> None:
    if _start is None:
        return
    os.environ.clear()
    os.environ.update(_start.env)
    try:
        os.chdir(_start.cwd)
    except OSError:
        pass
    sys.path[:] = _start.sys_path


_roots: tuple[str, ...] | None = None


def _library_roots() -> tuple[str, ...]:
    """The Python installation's directories, as written and resolved (computed once)."""
    global _roots
    if _roots is None:
        paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        paths.update(v for k, v in sysconfig.get_paths().items() if "lib" in k or k == "stdlib")
        try:
            paths.update(site.getsitepackages())
            paths.add(site.getusersitepackages())
        except AttributeError:  # a virtualenv's old site module
            pass
        paths.discard("")
        both = {os.path.abspath(p) for p in paths} | {os.path.realpath(p) for p in paths}
        _roots = tuple(p.rstrip(os.sep) + os.sep for p in both)
    return _roots


def is_user_module(name: str, module: Any, roots: tuple[str, ...]) -> bool:
    """True for a pure-Python module loaded from outside the Python installation.

    polytrain's own modules, ``__main__``, built-in and extension modules (which
    cannot be imported twice) and modules without a file are never user modules.
    """
    if name == "polytrain" or name.startswith(("polytrain.", "__main__", "__mp_main__")):
        return False
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py") or path.startswith(roots):
        return False
    return not os.path.realpath(path).startswith(roots)


def purge_user_modules() -> list[str]:
    """Forget the user modules imported since the start; returns their names."""
    start = _start.modules if _start is not None else frozenset()
    roots = _library_roots()
    purged = [
        name
        for name, module in list(sys.modules.items())
        if name not in start and is_user_module(name, module, roots)
    ]
    for name in purged:
        sys.modules.pop(name, None)
    return purged
