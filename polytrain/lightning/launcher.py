"""The Lightning launcher: a Trainer entry point on a polytrain worker group, on the run loop.

Every ``fit`` / ``validate`` / ``test`` / ``predict`` call is one run of the run loop
(:mod:`polytrain.runs.loop`): a fresh group (``make_group`` and the backend's
rendezvous), the entry point on every worker (:mod:`polytrain.lightning.worker_entry`),
the group torn down at the end. The run loop restarts it after a lost worker
(the strategy's ``max_retries``) and moves it off a draining node (``max_drains``)
as it does for every front end; this module says what the call's workers run and
where a restarted call resumes: a ``fit`` from the newest checkpoint Lightning
wrote during the call (:mod:`polytrain.lightning.restarts`) or from the checkpoint
it wrote at a drain (:mod:`polytrain.lightning.drain_stop`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies.launchers.launcher import _Launcher

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.torch_distributed import start_process_group
from polytrain.errors import RunStoppedError
from polytrain.launchers.base import WorkerGroup
from polytrain.lightning import drain_stop
from polytrain.lightning.restarts import (
    FIT_ENTRY,
    CheckpointFinder,
    call_name,
    ckpt_path_of,
    entry_name,
    pin_logger_versions,
    with_ckpt_path,
)
from polytrain.lightning.tune import TuneReportCallback, deliver_report
from polytrain.lightning.worker_entry import WorkerOutput, recover_results, run_on_worker
from polytrain.runs.loop import RunLoop
from polytrain.runs.watch.drains import DrainEvent
from polytrain.runs.workload import CallStoppedForDrain, DrainCheckpoint, Workload

logger = logging.getLogger(__name__)


class RayLauncher(_Launcher):
    """Runs a Trainer entry point (``_fit_impl``, ``_test_impl``, ...) on Ray actors.

    ``launch`` runs the call on the run loop: a worker group made by
    :func:`~polytrain.launchers.factory.make_group` (the strategy's ``scaling``),
    connected by the backend's rendezvous, one pickled copy of the Trainer, the
    LightningModule and the call's arguments sent to every actor, the entry point
    run there, and rank 0's results copied into the driver's Trainer and
    LightningModule. The group is torn down after each call. A worker's exception
    reaches the driver with its rank and remote traceback; a lost worker starts a
    new group instead, within the strategy's ``max_retries``; a ``fit`` whose node
    drains stops at a batch boundary, checkpoints there and continues in a new group
    off the node; other calls run again off it.

    Args:
        strategy: the :class:`~polytrain.lightning.RayStrategy` that owns this launcher.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._loop: RunLoop | None = None  # the running call's, never shipped to the workers

    @property
    def is_interactive_compatible(self) -> bool:
        """True: Ray actors start from notebooks (nothing is forked or re-run)."""
        return True

    @property
    def _group(self) -> WorkerGroup | None:
        return self._loop.group if self._loop is not None else None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every worker; return rank 0's result.

        A lost worker restarts the group, up to the strategy's ``max_retries`` over its
        life: a ``fit`` resumes from the newest checkpoint Lightning wrote during the
        call (see :mod:`polytrain.lightning.restarts`), other calls run again. A node of
        the group that drains is left, counted in ``num_drains`` (up to ``max_drains``):
        a ``fit`` stops at a batch boundary, checkpoints into
        ``<default_root_dir>/drain_checkpoints`` and continues from there in a new group
        (the file is removed once the fit completes); other calls run again.

        Raises:
            polytrain.errors.WorkerError: a worker raised (with its rank and traceback),
                or died once the restarts were spent.
            polytrain.errors.InsufficientResourcesError: the workers cannot be placed.
            polytrain.errors.DrainLimitError: a drain past ``max_drains`` (with the
                checkpoint of a fit to resume from).
        """
        if trainer is None:
            raise TypeError(
                "RayLauncher.launch needs the Trainer (trainer=...): it runs Trainer entry "
                "points (fit, validate, test, predict) only."
            )
        # Actors may run in another directory (or on another node): ship absolute paths.
        _absolutize_paths(trainer)
        strategy = self._strategy
        call = _EntryCall(strategy, trainer, function, args, kwargs)
        self._loop = RunLoop(
            call,
            strategy.backend,
            strategy.scaling,
            failure_policy=strategy.failure_policy,
            drain_policy=strategy.drain_policy,
            init_hook=strategy.init_hook,
        )
        try:
            output: WorkerOutput = call.run(self._loop)[0]
        finally:
            self._loop.close()
            self._loop = None
            call.finish()
        recover_results(output, trainer)
        return output.trainer_results

    def kill(self, signum: Any) -> None:
        """Stop the workers now (Lightning calls this on a second Ctrl+C)."""
        group = self._group
        if group is not None:
            group.shutdown()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loop"] = None  # actor handles stay with the driver
        return state


class _EntryCall(Workload):
    """One Trainer entry point on the run loop: its workers, its resume point, its drains."""

    def __init__(
        self, strategy: Any, trainer: Any, function: Callable, args: tuple, kwargs: dict
    ) -> None:
        self.strategy, self.trainer, self.function = strategy, trainer, function
        self.args, self.kwargs = args, kwargs
        self.name = call_name(function)
        fit = entry_name(function) == FIT_ENTRY
        watched = not strategy.scaling.local_mode
        #: A fit stops at a batch for a drain; other calls are left and run again.
        self.stoppable = fit and watched
        if fit and (strategy.max_retries > 0 or watched):
            # Every group of this call must log and checkpoint into the same directories.
            pin_logger_versions(trainer)
        self.finder = (
            CheckpointFinder.for_trainer(
                trainer, extra=[drain_stop.drain_directory(trainer.default_root_dir)]
            )
            if fit and strategy.max_retries > 0
            else None
        )
        self.tune_queue = _make_tune_queue(trainer)
        self.token, self.attempt = drain_stop.new_token(), 0
        self.drain_path: str | None = None  # where this attempt's fit checkpoints at a drain
        self.written: list[str] = []  # drain checkpoints of this call
        self._notice: Any = None  # rank 0's answer to the drain notice, pending
        self._notice_done = False
        self.loop: RunLoop | None = None

    # ------------------------------------------------------------- the call
    def run(self, loop: RunLoop) -> list[Any]:
        """Run the call on groups until one completes; returns every rank's output."""
        self.loop = loop
        while True:
            outputs = loop.call(
                run_on_worker,
                args_fn=self._attempt_args,
                per_rank=lambda rank: (
                    loop.group.rank_infos[rank],
                    loop.group.device_indices[rank],
                ),
            )
            if self.tune_queue is not None:  # the reports after the last poll
                _forward_tune_reports(self.tune_queue)
            stop = outputs[0] if outputs else None
            if not isinstance(stop, drain_stop.DrainStopped):
                if loop.pending_drain is not None:
                    logger.warning(
                        "The %s call ended before it could stop for the drain (%s): nothing "
                        "to move.",
                        self.name,
                        loop.pending_drain.describe(),
                    )
                for path in self.written:  # the fit completed: its drain checkpoints are spent
                    drain_stop.remove_checkpoint(path)
                return outputs
            self._move_off(loop, stop)

    def _attempt_args(self) -> tuple[Any, ...]:
        """One attempt's arguments: the Trainer payload, the cwd, the Tune queue, the drain path."""
        self.attempt += 1
        self.drain_path = (
            drain_stop.drain_checkpoint_path(
                self.trainer.default_root_dir, self.token, self.attempt
            )
            if self.stoppable
            else None
        )
        # A bound Trainer method travels as its name: the Trainer copy inside the
        # payload is the one it must run on.
        function = self.function
        if getattr(function, "__self__", None) is self.trainer:
            function = function.__name__
        payload = (self.trainer, function, self.args, self.kwargs)
        shared = payload if self.strategy.scaling.local_mode else _put(payload)
        return shared, os.getcwd(), self.tune_queue, self.drain_path

    def _move_off(self, loop: RunLoop, stop: drain_stop.DrainStopped) -> None:
        """A fit stopped at its drain checkpoint: the next attempt resumes from there, off the node."""
        path = stop.checkpoint_path
        if path is None or ("://" not in path and not os.path.isfile(path)):
            raise RunStoppedError(
                f"The fit stopped for a drain at {stop.where()}, but its checkpoint "
                f"{path} is not visible to the driver: give the Trainer a default_root_dir "
                f"on storage the driver and every worker share.",
                checkpoint_path=path,
            )
        for older in self.written:  # superseded by the newer one
            drain_stop.remove_checkpoint(older)
        self.written = [path]
        self.args, self.kwargs = with_ckpt_path(self.function, self.args, self.kwargs, path)
        loop.leave_drained_nodes(
            DrainCheckpoint(
                path=path,
                where=stop.where(),
                resume=f"Resume with trainer.fit(model, ckpt_path={path!r})",
            )
        )

    def finish(self) -> None:
        """After the call: the Tune queue goes."""
        if self.tune_queue is not None:
            self.tune_queue.shutdown()

    # ------------------------------------------------------ run loop hooks
    def context(self, world_size: int) -> WorkerContext:
        """Run loop: the strategy's worker context."""
        return self.strategy._context_template()

    def worker_env(self) -> dict[str, str]:
        """Run loop: Lightning's ``seed_everything`` seeds (``PL_*``), for the workers' ``reset_seed``."""
        return {k: v for k, v in os.environ.items() if k.startswith("PL_")}

    def setup_workers(self, group: WorkerGroup) -> None:
        """Run loop: a torch process group for Lightning's own collectives if the backend made none."""
        _ensure_torch_process_group(group, self.strategy._context_template())

    def started(self) -> None:
        """Run loop: a new group has not been told of any drain."""
        self._notice, self._notice_done = None, False

    def pollers(self) -> list[Callable[[], None]]:
        """Run loop: rank 0's Tune reports reach Tune while the call runs."""
        if self.tune_queue is None:
            return []
        return [lambda: _forward_tune_reports(self.tune_queue)]

    def after_failed_call(self, error: BaseException) -> None:
        """Run loop: what rank 0 reported before the failure (a trial's checkpoint) still reaches Tune."""
        if self.tune_queue is not None:
            _forward_tune_reports(self.tune_queue)

    def restart_source(self) -> str | None:
        """Run loop, a lost worker: a fit resumes from the newest checkpoint of the call, if any."""
        if self.finder is None:
            return f"the start of the {self.name} call"
        path = self.finder.newest()
        if path is not None:
            self.args, self.kwargs = with_ckpt_path(self.function, self.args, self.kwargs, path)
            return path
        given = ckpt_path_of(self.function, self.args, self.kwargs)
        start = f"ckpt_path={given!r}" if given else "the start of the fit"
        return f"{start} ({self.finder.describe_none()})"

    def on_drain(self, event: DrainEvent, new: bool) -> None:
        """Run loop: a fit stops at a batch (rank 0 is told); another call is left at once.

        Raises:
            CallStoppedForDrain: a validate/test/predict call (or a fit that cannot stop at
                a batch boundary) is left, to run again off the node.
        """
        if new and self.drain_path is None:
            logger.warning(
                "%s: the workers (%s) stop the running %s call, which runs again off the node.",
                event.describe(),
                event.describe_ranks(),
                self.name,
            )
            raise CallStoppedForDrain(
                event,
                DrainCheckpoint(
                    path=None,
                    where=f"the {self.name} call",
                    resume=f"Run the {self.name} call again",
                ),
            )
        if new:
            logger.warning(
                "%s: the workers (%s) finish their current batch, checkpoint there and the fit "
                "continues off the node.",
                event.describe(),
                event.describe_ranks(),
            )
        if self.drain_path is not None and not self._notice_done:
            self._deliver_notice()

    def _deliver_notice(self) -> None:
        """Hand rank 0 the drain notice (again, until its fit has a handler to take it)."""
        group = self.loop.group if self.loop is not None else None
        if group is None:
            return
        if self._notice is None:
            self._notice = group.monitor_single_async(0, "stop_request", {"drain": True})
            return
        done, reply = group.poll(self._notice)
        if not done:
            return
        self._notice = None
        delivered, refusal = drain_stop.notice_reply(reply)
        if not delivered:
            return  # rank 0 is not in its fit yet: the next poll sends it again
        self._notice_done = True
        if refusal is not None:
            logger.warning(
                "Rank 0 cannot stop this fit at a batch (%s): it runs on, and should the node "
                "go first the group restarts as after a lost worker (max_retries=%d).",
                refusal,
                self.strategy.max_retries,
            )


def _put(payload: Any) -> Any:
    """The payload in Ray's object store: one copy for every worker of the group."""
    import ray

    return ray.put(payload)


def _absolutize_paths(trainer: Any) -> None:
    root = getattr(trainer, "_default_root_dir", None)
    if isinstance(root, str) and "://" not in root:
        trainer._default_root_dir = os.path.abspath(root)
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if isinstance(dirpath, str) and "://" not in dirpath:
            callback.dirpath = os.path.abspath(dirpath)


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _ensure_torch_process_group(group: WorkerGroup, ctx: WorkerContext) -> None:
    """A torch.distributed group for Lightning's own collectives, if the backend made none.

    ``self.log(sync_dist=True)``, torchmetrics and Lightning's barriers talk
    through torch.distributed. Backends built on it (ddp, fairscale, fsdp,
    deepspeed) have set one up in their rendezvous; for the others (Horovod) a gloo
    group next to the backend's own communication carries these small messages.
    """
    if ctx.world_size < 2 or all(group.execute(_process_group_ready)):
        return
    start_process_group(group, ctx, "gloo")


def _make_tune_queue(trainer: Any) -> Any:
    if not any(isinstance(cb, TuneReportCallback) for cb in trainer.callbacks):
        return None
    from ray.util.queue import Queue

    # num_cpus=0: inside a Tune trial every CPU of the placement group is taken.
    return Queue(actor_options={"num_cpus": 0})


def _forward_tune_reports(queue: Any) -> None:
    while not queue.empty():
        deliver_report(queue.get_nowait())
