"""Local mode under torchrun: the function API's loop in torchrun's processes, without Ray.

``TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=0)).fit()``
in a process that ``torchrun`` started (every torchrun variable set:
:mod:`polytrain.launchers.torchrun`) runs the loop in that process as one rank of
torchrun's world, as Ray Train v2's local mode does: the default process group
is torchrun's (``init_method="env://"``; nccl with ``use_gpu``, else gloo, or the
backend config's ``dist_backend``; it stays for the process, and a later ``fit()``
uses it), each rank computes on its ``LOCAL_RANK``'s GPU,
and the backend's worker side (``prepare``, ``backward``, ``step``, ...) wraps and
shards as in a Ray worker. Ray is never imported.

Reports meet on rank 0 over a gloo group beside the training group (no GPU
synchronisation): ``report()`` is a collective (every rank calls it the same number
of times, as always), rank 0's report board commits checkpoints once every rank
has copied its files, and every rank's ``fit()`` returns the same :class:`Result`.
Trackers and report sinks run on rank 0 only.

What cannot run here is refused when ``fit()`` starts, naming what to do:
restarts (``FailureConfig.max_failures``: torchrun's ``--max-restarts`` restarts the
processes, and ``get_checkpoint()`` then returns the run's latest committed
checkpoint), the hang watchdog, Ray Data sets on several ranks, and backends that
do not meet through a ``torch.distributed`` process group (horovod, TensorFlow).
No node drains without Ray: ``get_preemption_info()`` is always None.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.core.torch_distributed import (
    TorchDistributedRendezvous,
    default_dist_backend,
    join_torchrun_process_group,
)
from polytrain.backends.registry import get_backend
from polytrain.checkpoint.storage import Storage
from polytrain.errors import ConfigError
from polytrain.launchers.torchrun import TorchrunWorld, torchrun_world
from polytrain.train import worker_entry
from polytrain.train.board import ReportBoard
from polytrain.train.result import Result
from polytrain.train.session import SessionMisuseError


class _Channel:
    """Object collectives over a gloo group of every rank (the default group when it is gloo)."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        self.world_size = world_size
        self.group = None
        if dist.get_backend() != "gloo":
            timeout = datetime.timedelta(seconds=timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def all_gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def from_rank0(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


class RankZeroBoard:
    """The run's :class:`~polytrain.train.board.ReportBoard` on rank 0, reached from every rank.

    Every rank makes the same calls in the same order (the driver's calls of
    ``fit()`` and each ``report()``); each is a collective of the gloo channel.

    Args:
        board: the board (rank 0), or None (other ranks).
        channel: the ranks' object collectives.
        rank: this process's world rank.
    """

    def __init__(self, board: ReportBoard | None, channel: _Channel, rank: int) -> None:
        self.board = board
        self.channel = channel
        self.rank = rank
        #: Called on rank 0 after each report (the trainer's report feed).
        self.listener: Any = None

    def _on_rank0(self, method: str, *args: Any) -> Any:
        value = getattr(self.board, method)(*args) if self.board is not None else None
        return self.channel.from_rank0(value)

    def new_attempt(self, world_size: int) -> int:
        """Driver: see :meth:`ReportBoard.new_attempt` (runs on rank 0, before any rank reports)."""
        return self._on_rank0("new_attempt", world_size)

    def latest_checkpoint(self) -> str | None:
        """The URL of the newest committed checkpoint, or None (rank 0's answer, everywhere)."""
        return self._on_rank0("latest_checkpoint")

    def snapshot(self) -> dict[str, Any]:
        """Driver: rank 0's history and committed checkpoints, on every rank."""
        return self._on_rank0("snapshot")

    def entries_since(self, count: int) -> list[dict[str, Any]]:
        """Rank 0's feed: the entries after the first ``count`` (no collective; [] elsewhere)."""
        return self.board.entries_since(count) if self.board is not None else []

    def report(
        self, index: int, rank: int, metrics: Any, has_checkpoint: bool, *extra: Any
    ) -> tuple[None, None]:
        """Worker: every rank's report of step ``index`` reaches rank 0's board together.

        The gather returns once every rank has made this report, after each copied its
        checkpoint files: rank 0 commits then. Nothing is announced without Ray, so
        the answer is ``(None, None)`` (no drain; see :meth:`ReportBoard.report`).

        Raises:
            SessionMisuseError: the ranks are at different reports (some rank called
                ``report()`` more or fewer times).
        """
        # ``extra``: the checkpoint's folder name, validation request and class (ReportBoard.report).
        reports = self.channel.all_gather((index, rank, metrics, has_checkpoint, *extra))
        indices = [r[0] for r in reports]
        if len(set(indices)) > 1:
            raise SessionMisuseError(
                f"report() calls out of step: ranks 0..{len(indices) - 1} are at reports "
                f"{indices}. Every rank must call polytrain.train.report() the same number of "
                f"times (a rank that skips or adds one deadlocks the others)."
            )
        if self.board is not None:
            for report in reports:
                self.board.report(*report)
            if self.listener is not None:
                self.listener()
        return None, None

    def collective(self, seq: int, rank: int, payload: Any) -> tuple[bool, Any]:
        """Worker: ``polytrain.train.collective`` over the gloo channel; ``(True, rank 0's payload)``."""
        return True, self.channel.all_gather(payload)[0]

    def reported_checkpoints(self, upto: int, validated: bool) -> list[tuple] | None:
        """Worker: rank 0's kept checkpoints, on every rank (a collective, as the reports are)."""
        return self._on_rank0("reported_checkpoints", upto, validated)

    def set_return_value(self, value: Any) -> None:
        """Worker (rank 0): what the loop returned."""
        if self.board is not None:
            self.board.set_return_value(value)


def _torch_backend(trainer: Any, world: TorchrunWorld) -> Backend:
    """The trainer's backend, if it can join torchrun's process group.

    Raises:
        ConfigError: a TensorFlow loop, or a backend whose workers meet otherwise.
    """
    framework = getattr(trainer._runner_cls, "framework", "torch")
    if framework != "torch":
        raise ConfigError(
            f"{type(trainer).__name__}(num_workers=0) under torchrun ({world.describe()}): "
            f"only torch loops join torchrun's process group. Run a TensorFlow loop as one "
            f"process (python script.py), or set num_workers."
        )
    backend = get_backend(trainer.backend, trainer.backend_config, framework="torch")
    rendezvous = backend.make_rendezvous()
    # The process group is torchrun's: a backend that needs one, or none (the no-op backend).
    if (
        not isinstance(rendezvous, TorchDistributedRendezvous)
        and type(rendezvous) is not Rendezvous
    ):
        raise ConfigError(
            f"backend {backend.name!r} cannot run in local mode (num_workers=0) under torchrun "
            f"({world.describe()}): its workers meet through its own rendezvous, not torchrun's "
            f"process group. Use ddp, fsdp, fairscale or deepspeed, start a horovod script "
            f"with horovodrun, or set num_workers."
        )
    return backend


def _refuse_unsupported(trainer: Any, world: TorchrunWorld) -> None:
    """Raise for the options local mode cannot carry out under torchrun.

    Raises:
        ConfigError: restarts, the hang watchdog, or Ray Data sets on several ranks.
    """
    failure = trainer.run_config.failure_config
    where = f"under torchrun ({world.describe()}), local mode (num_workers=0)"
    if failure.max_failures != 0:
        raise ConfigError(
            f"FailureConfig(max_failures={failure.max_failures}) {where} cannot restart: "
            f"torchrun owns the processes. Use torchrun --max-restarts N (a restarted loop's "
            f"get_checkpoint() returns the run's latest committed checkpoint) and leave "
            f"max_failures at 0, or set num_workers to run on Ray workers."
        )
    if failure.hang_timeout_s is not None:
        raise ConfigError(
            f"FailureConfig(hang_timeout_s={failure.hang_timeout_s}) {where}: the hang "
            f"watchdog needs a driver apart from the workers. Leave it None; "
            f"collective_timeout_s (now {failure.collective_timeout_s}) bounds a stuck "
            f"collective."
        )
    if trainer.datasets and world.world_size > 1:
        raise ConfigError(
            f"datasets={sorted(trainer.datasets)} {where} with {world.world_size} ranks: Ray "
            f"Data splits a data set among Ray workers only (as in Ray Train's local mode). "
            f"Read the data in the loop (a DataLoader with prepare_data_loader), or set "
            f"num_workers."
        )


def _rank0_view(trainer: Any, rank: int) -> Any:
    """The trainer as this rank drives it: trackers and report sinks on rank 0 only."""
    if rank == 0:
        return trainer
    view = copy.copy(trainer)
    view.run_config = dataclasses.replace(trainer.run_config, loggers=None)
    view._report_sinks = []
    return view


def fit_under_torchrun(trainer: Any) -> Result:
    """``trainer.fit()`` in local mode, in a process that torchrun started.

    Args:
        trainer: a :class:`~polytrain.train.trainer.DataParallelTrainer` with
            ``num_workers=0``.

    Returns:
        The same :class:`Result` on every rank: rank 0's reports and checkpoints.

    Raises:
        ConfigError: an option that cannot run under torchrun (see the module's docstring).
        Exception: what the loop raised, unchanged (torchrun then stops the other ranks).
    """
    world = torchrun_world()
    if world is None:
        raise ConfigError("fit_under_torchrun() needs a process that torchrun started.")
    backend = _torch_backend(trainer, world)
    _refuse_unsupported(trainer, world)
    scaling = trainer.scaling_config
    backend.validate_settings(
        num_workers=world.world_size, use_gpu=scaling.use_gpu, use_fp16=trainer.use_fp16
    )
    timeout_s = trainer.run_config.failure_config.collective_timeout_s
    device = world.local_rank if scaling.use_gpu else -1
    dist_backend = getattr(backend.config, "dist_backend", None)
    join_torchrun_process_group(  # kept for the process: a later fit() uses it too
        dist_backend or default_dist_backend(scaling.use_gpu),
        timeout_s,
        device if device >= 0 else None,
    )
    channel = _Channel(world.world_size, timeout_s)
    try:
        return _run(trainer, world, backend, channel, device)
    finally:
        channel.close()


def _run(
    trainer: Any, world: TorchrunWorld, backend: Backend, channel: _Channel, device: int
) -> Result:
    view = _rank0_view(trainer, world.rank)
    board = None
    if world.rank == 0:
        Storage(trainer.run_url).makedirs()
        board = ReportBoard(trainer.run_url, trainer.run_config.checkpoint_config)
    view.board = view.board_handle = RankZeroBoard(board, channel, world.rank)
    view._runner = None
    trackers = view._make_feed()
    try:
        start = view.board.new_attempt(world.world_size)
        latest = view.board.latest_checkpoint()
        if latest is None and trainer.resume_from_checkpoint is not None:
            latest = trainer.resume_from_checkpoint.path
        template = WorkerContext.from_scaling(
            trainer.scaling_config,
            world_size=world.world_size,
            use_fp16=trainer.use_fp16,
            timeout_s=trainer.run_config.failure_config.collective_timeout_s,
        )
        spec = worker_entry.LoopSpec(
            fn=trainer.train_loop_per_worker,
            config=trainer.train_loop_config,
            takes_config=trainer.takes_config,
            backend=backend,
            context=template,
            board=view.board,
            run_url=trainer.run_url,
            experiment_name=trainer.name,
            trial_name=trainer.trial_name,
            options=trainer.extras.worker_options(trainer),
        )
        shards = trainer.split_datasets(1)[0] if trainer.datasets else {}
        worker_entry.setup_session(spec, world.rank_info(), device, shards)
        worker_entry.run_loop(start, latest)  # no drains without Ray: it never stops early
        view.feed.poll()
        view.extras.finish()  # validations still running (rank 0)
        return view._result()
    finally:
        if trackers is not None:
            trackers.finish()


__all__ = ["RankZeroBoard", "fit_under_torchrun"]
