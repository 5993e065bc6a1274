"""``polytrain launch``: run an unmodified ``torchrun`` / ``horovodrun`` / ``deepspeed`` script on Ray.

Each worker actor runs ``python -u script.py args...`` as a child process with
the environment the script's native launcher gives it: ``torchrun``'s by
default (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT`` on rank 0's node,
``TORCHELASTIC_*``), ``horovodrun --gloo``'s with ``backend="horovod"`` (a
rendezvous server on the driver) and the ``deepspeed`` launcher's (plus
``--local_rank=N``) with ``backend="deepspeed"``; the registry names each
backend's :class:`~polytrain.backends.core.launch_env.LauncherEnv`.

Every rank's stdout and stderr lines reach the driver's console through the
workers' monitor channel, prefixed ``[rankN]:`` (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
changes it, as for ``torchrun``). The first rank that exits non-zero tears
the group down; the run is restarted up to ``max_restarts`` times, as ``torchrun
--max-restarts`` does, and then fails with that rank's exit code. The children
die with their actor (``PR_SET_PDEATHSIG``), so Ctrl-C stops every rank. The
attempts run on the run loop (:mod:`polytrain.runs.loop`), like every front end.
"""

from __future__ import annotations

import os
import re
import string
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from polytrain.backends.core.accelerate_launch import AccelerateLaunchEnv
from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.launch_env import LaunchAttempt, LauncherEnv
from polytrain.backends.registry import get_launcher_env_class, resolve_backend_name
from polytrain.errors import ConfigError, PolytrainError, WorkerError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.network import socket_ifname_env
from polytrain.launchers.scaling import ScalingConfig
from polytrain.launchers.worker import emit_output
from polytrain.runs.loop import RunLoop
from polytrain.runs.policies.failure import FailurePolicy
from polytrain.runs.workload import Workload

_EXIT = re.compile(r"exited with code (-?\d+)")

#: The line prefix, a template of ``${rank}``, ``${local_rank}`` and ``${role_name}``
#: (torchrun's macros); ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` replaces it.
DEFAULT_PREFIX = "[rank${rank}]:"

# Seconds the driver waits for the last output of the ranks once the run is over.
_DRAIN_WAIT_S = 3.0


class ScriptFailedError(PolytrainError, RuntimeError):
    """The script exited non-zero on a rank."""


@dataclass
class ScriptRun:
    """One launch attempt: the command, and every rank's environment, arguments and node."""

    command: list[str]
    envs: list[dict[str, str]]
    rank_args: list[list[str]] = field(default_factory=list)
    node_ips: list[str] = field(default_factory=list)
    use_gpu: bool = False

    def argv(self, rank: int) -> list[str]:
        """Rank ``rank``'s command line: the interpreter and script, the launcher's and the user's arguments."""
        extra = self.rank_args[rank] if self.rank_args else []
        return [*self.command[:3], *extra, *self.command[3:]]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _forward(pipe: IO[str], stream: str) -> None:
    for line in pipe:
        emit_output(line, stream)


def run_script(run: ScriptRun) -> int:
    """Worker: run the script with this rank's environment; raise if it exits non-zero."""
    rank = int(os.environ.get("POLYTRAIN_LAUNCH_RANK", "0"))
    env = {**os.environ, **run.envs[rank]}
    if run.node_ips:  # gloo's (and Horovod's) interface: the one holding this node's address
        env.update(socket_ifname_env(run.node_ips[rank], env, run.use_gpu))
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    argv = run.argv(rank)
    with subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        preexec_fn=preexec,  # noqa: PLW1509 - only a prctl call, before exec
    ) as child:
        readers = [
            threading.Thread(target=_forward, args=(pipe, name), daemon=True)
            for pipe, name in ((child.stdout, "stdout"), (child.stderr, "stderr"))
        ]
        for reader in readers:
            reader.start()
        code = child.wait()
        for reader in readers:
            reader.join()
    if code != 0:
        raise ScriptFailedError(f"{' '.join(argv)} exited with code {code} on rank {rank}")
    return code


def _set_rank(rank: int) -> None:
    os.environ["POLYTRAIN_LAUNCH_RANK"] = str(rank)


def line_prefixes(group: WorkerGroup, template: str | None = None) -> list[str]:
    """Every rank's line prefix from a torchrun-style template (default ``[rank${rank}]:``)."""
    tmpl = string.Template(template or DEFAULT_PREFIX)
    return [
        tmpl.safe_substitute(rank=info.world_rank, local_rank=info.local_rank, role_name="default")
        for info in group.rank_infos
    ]


class OutputPrinter:
    """Prints the ranks' queued output lines on the driver's console, each with its rank's prefix.

    Call :meth:`poll` regularly while the group runs (it never waits) and
    :meth:`drain` once the run is over.
    """

    def __init__(self, group: WorkerGroup, prefixes: list[str]) -> None:
        self._group, self._prefixes = group, prefixes
        self._pending: dict[int, Any] = {}

    def _print(self, rank: int, lines: list[tuple[str, str]] | None) -> None:
        for stream, line in lines or ():
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write(f"{self._prefixes[rank]}{line}" + ("" if line.endswith("\n") else "\n"))
        if lines:
            sys.stdout.flush()
            sys.stderr.flush()

    def poll(self) -> None:
        """Print what came in and ask every rank again."""
        for rank in range(len(self._prefixes)):
            ref = self._pending.get(rank)
            if ref is not None:
                done, lines = self._group.poll(ref)
                if not done:
                    continue
                self._print(rank, lines)
            self._pending[rank] = self._group.monitor_single_async(rank, "output")

    def drain(self, timeout_s: float = _DRAIN_WAIT_S) -> None:
        """Print every rank's remaining lines (a dead rank's are lost), waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for final in (False, True):
            while self._pending and time.monotonic() < deadline:
                for rank, ref in list(self._pending.items()):
                    done, lines = self._group.poll(ref)
                    if done:
                        del self._pending[rank]
                        self._print(rank, lines)
                time.sleep(0.02)
            if not final:  # one last call per rank, after the script's end
                self._pending = {
                    r: self._group.monitor_single_async(r, "output")
                    for r in range(len(self._prefixes))
                }
        self._pending = {}


class _ScriptWorkload(Workload):
    """``polytrain launch`` on the run loop: every attempt runs the script once on every rank."""

    #: A failed rank's siblings may sit in a collective with children of their own: kill them.
    kill_failed_groups = True

    def __init__(
        self,
        command: list[str],
        scaling: ScalingConfig,
        launcher: LauncherEnv,
        run_id: str,
        max_restarts: int,
    ) -> None:
        self.command, self.scaling, self.launcher = command, scaling, launcher
        self.attempt = LaunchAttempt(0, max_restarts, run_id)
        self.script_run: ScriptRun | None = None
        self.printer: OutputPrinter | None = None

    def context(self, world_size: int) -> WorkerContext:
        """Run loop: the ranks' context (the script connects them itself)."""
        return WorkerContext.from_scaling(self.scaling, world_size=world_size)

    def setup_workers(self, group: WorkerGroup) -> None:
        """Run loop: every rank's launcher environment for this attempt, and its output printer."""
        self.launcher.stop()  # the previous attempt's rendezvous server, if any
        envs = self.launcher.envs(group, self.attempt)
        threads = str(max(1, int(self.scaling.num_cpus_per_worker)))
        for env in envs:
            env.setdefault("OMP_NUM_THREADS", threads)
        group.get([group.execute_single_async(r, _set_rank, r) for r in range(len(group))])
        self.script_run = ScriptRun(
            self.command,
            envs,
            rank_args=[self.launcher.script_args(info) for info in group.rank_infos],
            node_ips=[meta.node_ip for meta in group.metadata],
            use_gpu=bool(self.scaling.num_gpus_per_worker),
        )
        prefixes = line_prefixes(group, os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
        self.printer = OutputPrinter(group, prefixes)

    def pollers(self) -> list[Callable[[], None]]:
        """Run loop: print the ranks' lines while the script runs."""
        return [self.printer.poll] if self.printer is not None else []

    def after_failed_call(self, error: BaseException) -> None:
        """Run loop: the failing rank's last lines (its traceback), then say what happens next."""
        if isinstance(error, KeyboardInterrupt):
            return
        if self.printer is not None:
            self.printer.drain()
        if isinstance(error, WorkerError):
            _report(error, exit_code(error), self.attempt.restart, self.attempt.max_restarts)

    def before_restart(self, planned: bool) -> None:
        """Run loop: the next attempt (``TORCHELASTIC_RESTART_COUNT`` and friends)."""
        attempt = self.attempt
        self.attempt = LaunchAttempt(attempt.restart + 1, attempt.max_restarts, attempt.run_id)


def exit_code(error: BaseException) -> int:
    """The script's exit code in a launch failure (1 when a worker died otherwise)."""
    found = _EXIT.search(str(error))
    return int(found.group(1)) if found else 1


def _check_args(script: str, num_workers: int, max_restarts: int) -> None:
    if not os.path.isfile(script):
        raise ConfigError(
            f"polytrain launch: script {script!r} is not a file (looked in {os.getcwd()}); "
            f"give the path of the training script."
        )
    if num_workers < 1 or max_restarts < 0:
        raise ConfigError(
            f"polytrain launch needs -n >= 1 and --max-restarts >= 0; got -n {num_workers}, "
            f"--max-restarts {max_restarts}."
        )


def _report(error: WorkerError, code: int, restart: int, max_restarts: int) -> None:
    what = f"polytrain launch: rank {error.rank} failed (exit code {code})"
    if restart < max_restarts:
        what += f"; restart {restart + 1} of {max_restarts}"
    print(what, file=sys.stderr, flush=True)


def _script_loop(workload: _ScriptWorkload, scaling: ScalingConfig, max_restarts: int) -> RunLoop:
    return RunLoop(
        workload,
        Backend(),  # no rendezvous: the script connects its ranks itself
        scaling,
        # Any failed rank restarts every rank, as torchrun --max-restarts does.
        failure_policy=FailurePolicy(
            max_restarts, retryable=(WorkerError,), option="--max-restarts"
        ),
        watch_drains=False,  # a script stops at no agreed step: a drained node is a lost rank
    )


def _launcher(
    backend: str | None,
    accelerate_config: str | None,
    gpus_per_worker: float,
    num_workers: int,
    local_rank_arg: bool,
) -> LauncherEnv:
    """The ranks' launcher environment: the backend's, or ``accelerate launch``'s for a config file."""
    if accelerate_config is None:
        return get_launcher_env_class(backend or "ddp")(local_rank_arg=local_rank_arg)
    canonical = resolve_backend_name(backend) if backend else None
    return AccelerateLaunchEnv(accelerate_config, canonical, bool(gpus_per_worker), num_workers)


def launch(
    script: str,
    args: list[str] | None = None,
    *,
    num_workers: int = 1,
    backend: str | None = None,
    cpus_per_worker: float = 1,
    gpus_per_worker: float = 0,
    max_restarts: int = 0,
    local_rank_arg: bool = True,
    address: str | None = None,
    accelerate_config: str | None = None,
) -> int:
    """Run ``python script args...`` on ``num_workers`` Ray workers as its native launcher would.

    Args:
        script: the training script, unmodified.
        args: its arguments.
        num_workers: the number of ranks.
        backend: whose launcher environment the ranks get: ``"ddp"`` (``torchrun``;
            also ``fsdp`` and ``fairscale``; the default), ``"horovod"`` (``horovodrun
            --gloo``) or ``"deepspeed"`` (the ``deepspeed`` launcher), or an alias of one;
            with ``accelerate_config``, the backend the config must be (None: its own).
        cpus_per_worker: CPUs per rank (also its ``OMP_NUM_THREADS`` unless set).
        gpus_per_worker: GPUs per rank.
        max_restarts: restart every rank this often after a failure.
        local_rank_arg: ``backend="deepspeed"`` appends ``--local_rank=N`` to the
            script's arguments, as the launcher does without ``--no_local_rank``.
        address: the Ray cluster (None: ``RAY_ADDRESS`` or a local one).
        accelerate_config: an Accelerate config file: ``accelerate launch``'s environment.

    Returns:
        0, or the exit code of the first failing rank once the restarts are spent.

    Raises:
        ConfigError: no script, a bad count, an Accelerate config against backend / GPUs.
        UnknownBackendError: a backend without a launcher environment.
        MissingDependencyError: the backend's framework is not installed.
    """
    _check_args(script, num_workers, max_restarts)
    scaling = ScalingConfig(
        num_workers=num_workers,
        num_cpus_per_worker=cpus_per_worker,
        num_gpus_per_worker=gpus_per_worker or None,
        address=address,
    )
    command = [sys.executable, "-u", os.path.abspath(script), *(args or [])]
    launcher = _launcher(backend, accelerate_config, gpus_per_worker, num_workers, local_rank_arg)
    workload = _ScriptWorkload(command, scaling, launcher, uuid.uuid4().hex[:12], max_restarts)
    loop = _script_loop(workload, scaling, max_restarts)
    try:
        loop.start()  # the first attempt's environments exist once its group does
        loop.call(run_script, args_fn=lambda: (workload.script_run,))
        workload.printer.drain()
        return 0
    except WorkerError as error:
        return exit_code(error)
    finally:
        loop.close()
        launcher.stop()
