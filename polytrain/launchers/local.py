"""The worker-group contract in the driver process (``num_workers=0``): no Ray, no actors.

For debugging: breakpoints, ``pdb`` and profilers work in creators and operators,
and exceptions propagate unchanged.

Under ``torchrun`` with ``WORLD_SIZE=1`` (:mod:`polytrain.launchers.torchrun`) the one
worker is rank 0 of torchrun's world: it computes on ``LOCAL_RANK``'s device and the
backend's rendezvous joins torchrun's process group, so the backends wrap and shard
as in any worker. Several torchrun processes are refused here: each would drive its
own copy of the run (the function API, :mod:`polytrain.train.local`, joins a world of
any size).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from polytrain.errors import ConfigError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.ranks import RankInfo, WorkerMetadata, compute_ranks
from polytrain.launchers.torchrun import TorchrunWorld, torchrun_world
from polytrain.launchers.worker import Worker


class _Done:
    """A finished call, standing in for an object ref."""

    def __init__(self, value: Any) -> None:
        self.value = value


class LocalWorkerGroup(WorkerGroup):
    """One in-process "worker" implementing :class:`~polytrain.launchers.base.WorkerGroup`.

    Calls run at once in the caller's thread, so the "refs" returned by the
    ``*_async`` methods are already finished. Environment variables the workers
    would start with are set in the driver while the group runs and restored by
    :meth:`shutdown`.

    Args:
        env_vars: environment the worker would start with.

    Attributes:
        torchrun: the torchrun world this process is rank 0 of (None: not under torchrun),
            set by :meth:`start`.
    """

    def __init__(self, env_vars: dict[str, str] | None = None) -> None:
        self.env_vars = dict(env_vars or {})
        self.torchrun: TorchrunWorld | None = None
        self._saved_env: dict[str, str | None] = {}
        self.worker = Worker.__new__(Worker)  # no __init__: leave the driver's priority alone
        self.actors = [self.worker]
        self.metadata: list[WorkerMetadata] = []
        self.rank_infos: list[RankInfo] = []
        self.device_indices = [-1]

    def start(self) -> None:
        """Set the workers' environment in this process.

        Raises:
            ConfigError: this process is one of several torchrun processes.
        """
        world = torchrun_world()
        if world is not None and world.world_size > 1:
            raise ConfigError(
                f"Local mode (num_workers=0) runs under torchrun only with WORLD_SIZE=1; this "
                f"process is {world.describe()}, and each of the {world.world_size} processes "
                f"would drive its own copy of the run. Start one process (torchrun "
                f"--nproc-per-node 1), run your own loop with the function API "
                f"(polytrain.train.torch.TorchTrainer(train_loop_per_worker, scaling_config="
                f"ScalingConfig(num_workers=0)) joins a torchrun world of any size), or set "
                f"num_workers to the number of workers (Ray actors)."
            )
        self.torchrun = world
        for key, value in self.env_vars.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        self.metadata = [WorkerMetadata("local", "127.0.0.1", socket.gethostname(), os.getpid())]
        self.rank_infos = compute_ranks(["local"])
        if world is not None:  # torchrun's convention: the process computes on LOCAL_RANK's GPU
            self.device_indices = [world.local_rank]

    def __len__(self) -> int:
        return 1

    def execute_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` now (there is nothing to overlap with) and return a finished "ref"."""
        return [_Done(fn(*args, **kwargs))]

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` in this process; returns ``[result]``."""
        return [fn(*args, **kwargs)]

    def execute_single_async(
        self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``fn`` now; return a finished "ref"."""
        return _Done(fn(*args, **kwargs))

    def execute_single(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in this process and return its result."""
        return fn(*args, **kwargs)

    def execute_best_effort(self, fn: Callable[..., Any], timeout_s: float = 5.0) -> None:
        """Run ``fn`` in this process; failures are ignored (clean-up on shutdown)."""
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort by definition
            pass

    def monitor(self, method: str, timeout_s: float = 10.0) -> list[Any]:
        """Call a monitor method of the in-process worker."""
        return [getattr(self.worker, method)()]

    def monitor_single_async(self, rank: int, method: str, *args: Any) -> Any:
        """Call a monitor method of the in-process worker; return a finished "ref"."""
        return _Done(getattr(self.worker, method)(*args))

    def poll(self, ref: Any) -> tuple[bool, Any]:
        """Always ``(True, value)``: every call here finished when it was made."""
        return True, ref.value

    def get(
        self,
        refs: Sequence[Any],
        ranks: Sequence[int] | None = None,
        on_poll: Callable[[], None] | None = None,
        poll_interval_s: float = 0.5,
    ) -> list[Any]:
        """The values of finished calls."""
        return [ref.value for ref in refs]

    def shutdown(self) -> None:
        """Restore the driver's environment. Safe to call twice."""
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
