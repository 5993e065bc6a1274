"""The environment a native launcher gives each rank, for ``polytrain launch``.

A :class:`LauncherEnv` is the driver side of one launcher (``torchrun``,
``horovodrun --gloo``, the ``deepspeed`` launcher): for a started worker group
it gives every rank the variables that launcher would set, the arguments it
appends to the script's command line, and stops what it started (a rendezvous
server) afterwards. The registry names each backend's launcher
(``BackendSpec.launcher``); :class:`TorchrunEnv` is the ``torch.distributed`` one.
No framework is imported at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from polytrain.launchers.ranks import RankInfo, torch_distributed_env
from polytrain.launchers.worker import find_free_port

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup


@dataclass(frozen=True)
class LaunchAttempt:
    """One attempt of a launch: its restart count out of ``max_restarts``, and the run's id."""

    restart: int
    max_restarts: int
    run_id: str


class LauncherEnv:
    """A launcher's per-rank environment and arguments (the base sets none).

    Args:
        local_rank_arg: pass ``--local_rank=N`` to the script where the launcher
            does (the ``deepspeed`` launcher without ``--no_local_rank``).
    """

    #: The launcher a script written for it was started by (for messages).
    launcher = "python"

    def __init__(self, local_rank_arg: bool = True) -> None:
        self.local_rank_arg = local_rank_arg

    def envs(self, group: WorkerGroup, attempt: LaunchAttempt) -> list[dict[str, str]]:
        """Driver: every rank's environment, in world-rank order."""
        return [{} for _ in group.rank_infos]

    def script_args(self, info: RankInfo) -> list[str]:
        """Arguments the launcher puts before the script's own (none by default)."""
        return []

    def stop(self) -> None:
        """Driver: stop what :meth:`envs` started (nothing by default)."""


class TorchrunEnv(LauncherEnv):
    """``torchrun``'s environment: ranks, ``MASTER_ADDR``/``PORT`` of rank 0, ``TORCHELASTIC_*``."""

    launcher = "torchrun"

    def envs(self, group: WorkerGroup, attempt: LaunchAttempt) -> list[dict[str, str]]:
        """Driver: torchrun's variables for every rank; the master port is free on rank 0's host."""
        master_addr = group.metadata[0].node_ip
        master_port = group.execute_single(0, find_free_port)
        nodes = 1 + max(info.node_rank for info in group.rank_infos)
        envs = []
        for info in group.rank_infos:
            env = torch_distributed_env(info, master_addr, master_port)
            env.update(
                ROLE_RANK=str(info.world_rank),
                ROLE_WORLD_SIZE=str(info.world_size),
                ROLE_NAME="default",
                GROUP_WORLD_SIZE=str(nodes),
                TORCHELASTIC_RESTART_COUNT=str(attempt.restart),
                TORCHELASTIC_MAX_RESTARTS=str(attempt.max_restarts),
                TORCHELASTIC_RUN_ID=attempt.run_id,
            )
            envs.append(env)
        return envs
