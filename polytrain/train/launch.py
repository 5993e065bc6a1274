"""``polytrain launch``: run an unmodified ``torchrun`` script on N Ray workers.

Each worker actor runs ``python script.py args...`` as a child process with the
environment ``torchrun`` gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT`` on rank 0's
node, ``TORCHELASTIC_RESTART_COUNT`` / ``TORCHELASTIC_MAX_RESTARTS`` /
``TORCHELASTIC_RUN_ID``), prints its output line by line prefixed ``[rankN]:``
(as ``torchrun --tee`` with ``--log-line-prefix``), and fails when the script
exits non-zero: the group is torn down at the first failing rank, and the run
is restarted up to ``max_restarts`` times, as ``torchrun --max-restarts`` does.
The children die with their actor (``PR_SET_PDEATHSIG``), so Ctrl-C stops every rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.errors import ConfigError, PolytrainError, WorkerError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.ranks import torch_distributed_env
from polytrain.launchers.scaling import ScalingConfig
from polytrain.trainer_api.trainer import BaseTrainer

_EXIT = re.compile(r"exited with code (-?\d+)")


class ScriptFailedError(PolytrainError, RuntimeError):
    """The script exited non-zero on a rank."""


@dataclass
class ScriptRun:
    """One launch attempt: the command and the environment of every rank."""

    command: list[str]
    envs: list[dict[str, str]]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_script(run: ScriptRun) -> int:
    """Worker: run the script with this rank's environment; raise if it exits non-zero."""
    rank = int(os.environ.get("POLYTRAIN_LAUNCH_RANK", "0"))
    env = {**os.environ, **run.envs[rank]}
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    with subprocess.Popen(
        run.command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        preexec_fn=preexec,  # noqa: PLW1509 - only a prctl call, before exec
    ) as child:
        for line in child.stdout:
            print(f"[rank{rank}]:{line}", end="", flush=True)
        code = child.wait()
    if code != 0:
        raise ScriptFailedError(f"{' '.join(run.command)} exited with code {code} on rank {rank}")
    return code


def _set_rank(rank: int) -> None:
    os.environ["POLYTRAIN_LAUNCH_RANK"] = str(rank)


class _ScriptRunner(BaseTrainer):
    """A worker group that runs one launch attempt."""

    def __init__(self, command: list[str], scaling: ScalingConfig, restart: int, max_restarts: int):
        self.command, self.restart, self.max_restarts = command, restart, max_restarts
        self.run_id = uuid.uuid4().hex[:12]
        super().__init__(
            backend=Backend(), scaling_config=scaling, failure_config={"max_retries": 0}
        )
        self._start()

    def _setup_workers(self, group: WorkerGroup) -> None:
        master_addr = group.metadata[0].node_ip
        from polytrain.launchers.worker import find_free_port

        master_port = group.execute_single(0, find_free_port)
        extra = {
            "TORCHELASTIC_RESTART_COUNT": str(self.restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "OMP_NUM_THREADS": str(max(1, int(self.scaling.num_cpus_per_worker))),
        }
        envs = [
            {**torch_distributed_env(info, master_addr, master_port), **extra}
            for info in group.rank_infos
        ]
        for info in group.rank_infos:
            envs[info.world_rank]["ROLE_RANK"] = str(info.world_rank)
            envs[info.world_rank]["ROLE_WORLD_SIZE"] = str(info.world_size)
        group.get([group.execute_single_async(r, _set_rank, r) for r in range(len(group))])
        self.script_run = ScriptRun(self.command, envs)

    def _worker_state(self) -> dict[str, Any]:
        raise ConfigError("polytrain launch holds no state.")

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        raise ConfigError("polytrain launch holds no state.")

    def run(self) -> None:
        self._run(run_script, self.script_run)


def exit_code(error: BaseException) -> int:
    """The script's exit code in a launch failure (1 when a worker died otherwise)."""
    found = _EXIT.search(str(error))
    return int(found.group(1)) if found else 1


def launch(
    script: str,
    args: list[str] | None = None,
    *,
    num_workers: int = 1,
    cpus_per_worker: float = 1,
    gpus_per_worker: float = 0,
    max_restarts: int = 0,
    address: str | None = None,
) -> int:
    """Run ``python script args...`` on ``num_workers`` Ray workers as ``torchrun`` would.

    Returns:
        0, or the exit code of the first failing rank once the restarts are spent.

    Raises:
        ConfigError: the script does not exist, or a bad count.
    """
    if not os.path.isfile(script):
        raise ConfigError(f"polytrain launch: script {script!r} is not a file.")
    if num_workers < 1 or max_restarts < 0:
        raise ConfigError(
            f"polytrain launch needs -n >= 1 and --max-restarts >= 0; got -n {num_workers}, "
            f"--max-restarts {max_restarts}."
        )
    scaling = ScalingConfig(
        num_workers=num_workers,
        num_cpus_per_worker=cpus_per_worker,
        num_gpus_per_worker=gpus_per_worker or None,
        address=address,
    )
    command = [sys.executable, os.path.abspath(script), *(args or [])]
    for restart in range(max_restarts + 1):
        runner = _ScriptRunner(command, scaling, restart, max_restarts)
        try:
            runner.run()
            return 0
        except WorkerError as error:
            code = exit_code(error)
            print(
                f"polytrain launch: rank {error.rank} failed (exit code {code}); "
                f"restart {restart + 1} of {max_restarts}"
                if restart < max_restarts
                else f"polytrain launch: rank {error.rank} failed (exit code {code})",
                file=sys.stderr,
                flush=True,
            )
            if restart == max_restarts:
                return code
        finally:
            runner.shutdown()
    return 1  # pragma: no cover - the loop returns
