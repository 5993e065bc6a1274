"""The Lightning cluster environment of a polytrain worker group."""

from __future__ import annotations

from lightning_fabric.plugins.environments import ClusterEnvironment


class WorkerGroupEnvironment(ClusterEnvironment):
    """Ranks as the polytrain worker group assigned them.

    The worker group, not Lightning, starts the processes and the backend's
    rendezvous (its ``on_start``), not Lightning, connects them; this environment only
    tells Lightning where the current process sits. On the driver it describes
    rank 0 of a group of ``world_size`` workers that does not exist yet.

    Args:
        world_size: the number of workers.
    """

    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        self._world_size = world_size
        self._global_rank = 0
        self._local_rank = 0
        self._node_rank = 0

    @property
    def creates_processes_externally(self) -> bool:
        """True: the worker group starts the processes, Lightning must not."""
        return True

    @property
    def main_address(self) -> str:
        """Unused: the backend's rendezvous connected the workers."""
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        """Unused: the backend's rendezvous connected the workers."""
        return 0

    @staticmethod
    def detect() -> bool:
        """Never chosen automatically; :class:`~polytrain.lightning.RayStrategy` sets it."""
        return False

    def world_size(self) -> int:
        """The number of workers."""
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Ignored: the size is the worker group's (Lightning calls this with its own count)."""

    def global_rank(self) -> int:
        """This worker's world rank (0 on the driver)."""
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Ignored: ranks come from the worker group (see :meth:`assign`)."""

    def local_rank(self) -> int:
        """This worker's rank among the workers on its node."""
        return self._local_rank

    def node_rank(self) -> int:
        """The rank of this worker's node."""
        return self._node_rank

    def assign(self, world_rank: int, local_rank: int, node_rank: int, world_size: int) -> None:
        """Worker: take the ranks the worker group computed for this process."""
        self._global_rank = world_rank
        self._local_rank = local_rank
        self._node_rank = node_rank
        self._world_size = world_size
