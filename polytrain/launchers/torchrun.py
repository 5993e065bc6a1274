"""The world ``torchrun`` put this process in, read from its environment (no Ray, no torch).

``torchrun`` (and ``polytrain launch``, which gives Ray workers the same variables)
starts every process with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``: what
``torch.distributed.init_process_group(init_method="env://")`` reads. Local mode
(``num_workers=0``) in such a process joins that world instead of running alone,
as Ray Train v2's local mode does under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.errors import ConfigError
from polytrain.launchers.ranks import RankInfo

#: What ``init_method="env://"`` needs; a process that has all of them was started by torchrun.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True)
class TorchrunWorld:
    """This process's place in torchrun's world.

    Attributes:
        rank: ``RANK``, the world rank.
        local_rank: ``LOCAL_RANK``, the rank on this node (the CUDA device index by
            torchrun's convention).
        world_size: ``WORLD_SIZE``.
        local_world_size: ``LOCAL_WORLD_SIZE``, processes on this node.
        node_rank: ``GROUP_RANK`` (torchrun's node rank), else ``rank // local_world_size``.
        master_addr: ``MASTER_ADDR``.
        master_port: ``MASTER_PORT``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def rank_info(self) -> RankInfo:
        """This process as a :class:`~polytrain.launchers.ranks.RankInfo`."""
        return RankInfo(
            world_rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            node_rank=self.node_rank,
        )

    def describe(self) -> str:
        """``"rank R of N (local rank L, node K)"``, for messages."""
        return (
            f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}, "
            f"node {self.node_rank})"
        )


def torchrun_world(environ: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """The torchrun world of this process, or None when it was not started by torchrun.

    Args:
        environ: the environment to read (default: ``os.environ``).

    Raises:
        ConfigError: the variables are there but not numbers, or contradict each other.
    """
    env = os.environ if environ is None else environ
    if not all(key in env for key in TORCHRUN_VARS):
        return None
    try:
        rank, local_rank, world_size, local_world_size, port = (
            int(env[key])
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")
        )
        group_rank = env.get("GROUP_RANK")
        node_rank = int(group_rank) if group_rank else rank // max(local_world_size, 1)
    except ValueError:
        shown = {key: env.get(key) for key in (*TORCHRUN_VARS, "GROUP_RANK")}
        raise ConfigError(
            f"The torchrun variables of this process are not numbers: {shown}. Start it with "
            f"torchrun (or unset them to run in one process)."
        ) from None
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise ConfigError(
            f"The torchrun variables contradict each other: RANK={rank}, LOCAL_RANK="
            f"{local_rank}, WORLD_SIZE={world_size}, LOCAL_WORLD_SIZE={local_world_size}. "
            f"Start the process with torchrun, which sets them together."
        )
    return TorchrunWorld(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=env["MASTER_ADDR"],
        master_port=port,
    )


__all__ = ["TORCHRUN_VARS", "TorchrunWorld", "torchrun_world"]
