"""The ``deepspeed`` launcher's environment for ``polytrain launch --backend deepspeed``.

As ``deepspeed/launcher/launch.py`` does, every rank gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's node), ``CROSS_RANK``
(the node's rank), ``CROSS_SIZE`` (the number of nodes) and ``LOCAL_SIZE``, and
``--local_rank=N`` before the script's own arguments (``--no-local-rank``, the
launcher's ``--no_local_rank``, leaves it out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polytrain.backends.core.launch_env import LaunchAttempt, TorchrunEnv
from polytrain.launchers.ranks import RankInfo

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup


class DeepSpeedLauncherEnv(TorchrunEnv):
    """The ``deepspeed`` launcher: torch's rank variables, its node variables, ``--local_rank``."""

    launcher = "deepspeed"

    def envs(self, group: WorkerGroup, attempt: LaunchAttempt) -> list[dict[str, str]]:
        """Driver: the launcher's variables for every rank (torchrun's ``TORCHELASTIC_*`` not)."""
        nodes = str(1 + max(info.node_rank for info in group.rank_infos))
        envs = []
        for env, info in zip(super().envs(group, attempt), group.rank_infos, strict=True):
            keep = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
            envs.append(
                {key: env[key] for key in keep}
                | {
                    "CROSS_RANK": str(info.node_rank),
                    "CROSS_SIZE": nodes,
                    "LOCAL_SIZE": str(info.local_world_size),
                }
            )
        return envs

    def script_args(self, info: RankInfo) -> list[str]:
        """``--local_rank=N``, as the launcher appends it (unless turned off)."""
        return [f"--local_rank={info.local_rank}"] if self.local_rank_arg else []
