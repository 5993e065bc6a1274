"""The run loop: one driver-side loop under every front end.

:class:`RunLoop` owns a run's worker groups: it starts one (through
:func:`~polytrain.launchers.factory.make_group` and the backend's rendezvous),
runs calls on it while watching it (hang watchdog, drains, a progress bar),
asks the policies what a failure, a drain or a shrunk cluster means (decisions as
data, :mod:`polytrain.runs.policies`) and carries the decision out: restart the
group from the latest state, resize it, move it off a draining node, or stop. The
creator-API trainers, the function API, the Lightning launcher and ``polytrain
launch`` all run on it; each only says, through a
:class:`~polytrain.runs.workload.Workload`, what its workers run and how its state
is saved and restored. One call's way::

    front end --call(fn)--> RunLoop --execute_async--> WorkerGroup (Ray actors | local)
        ^                     | poll every 0.25 s: HangWatchdog, DrainWatch, progress
        |                     | failure -> FailurePolicy -> RETRY: restart() + workload.restore()
        |                     |                          -> RAISE: tear down, close, raise
        |                     | drain   -> workload.on_drain (stop at a step / announce / abort)
        +-- results ----------+ stopped for a drain -> leave_drained_nodes() -> DrainPolicy
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.errors import DrainLimitError, TerminatedError, TrainerShutdownError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.factory import make_group, placeable_workers
from polytrain.launchers.scaling import ScalingConfig
from polytrain.runs.policies.drain import DrainPolicy, StopRun
from polytrain.runs.policies.failure import FailureDecision, FailurePolicy, describe_loss
from polytrain.runs.policies.scaling import ScalingPolicy
from polytrain.runs.watch.drains import DrainEvent, DrainWatch
from polytrain.runs.watch.hang import HangWatchdog
from polytrain.runs.watch.progress import ProgressReporter
from polytrain.runs.watch.termination import TerminationWatch
from polytrain.runs.workload import CallStoppedForDrain, DrainCheckpoint, Workload

logger = logging.getLogger(__name__)

#: Seconds between two rounds of the poll hooks while a call runs.
POLL_INTERVAL_S = 0.25


def shutdown_group(rendezvous: Rendezvous | None, group: WorkerGroup, force: bool = False) -> None:
    """Stop a group: the backend's clean-up, then back to the warm pool; ``force``: kill at once.

    Module-level (not a method): the finalizer that calls it must not keep the loop alive.
    """
    if force:
        # No clean-up call that could wait on a stuck worker, and no warm pool for
        # workers whose process groups were never torn down: kill them now.
        getattr(group, "terminate", group.shutdown)()
        return
    if rendezvous is not None:
        rendezvous.shutdown(group)  # never raises: dead workers are shut down too
    group.shutdown()


def _submit_per_rank(
    group: WorkerGroup,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    per_rank: Callable[[int], tuple[Any, ...]],
) -> list[Any]:
    return [group.execute_single_async(r, fn, *args, *per_rank(r)) for r in range(len(group))]


def _placeable_off_draining(scaling: ScalingConfig, watch: DrainWatch) -> int:
    # Ray places nothing new on a draining node but still counts its free resources.
    return placeable_workers(scaling, watch.draining)


class RunLoop:
    """The worker groups of one run, and everything that happens to them.

    Args:
        workload: the front end's hooks (what the workers run, how state moves).
        backend: the backend whose rendezvous connects every group.
        scaling: workers, resources, placement, local mode.
        failure_policy: which failed calls restart the group.
        drain_policy: how many drains the run survives (default: unlimited).
        hang_timeout_s: the hang watchdog's timeout; None: no watchdog.
        init_hook: run on every worker of every group, before the backend connects them.
        use_tqdm: show rank 0's progress as a bar while a call with a ``progress``
            label runs.
        watch_drains: watch Ray's draining nodes while calls run (never in local mode).
        termination_enabled: install the driver's SIGTERM watch during
            :meth:`TerminationWatch.watching` blocks (needs somewhere to checkpoint).
    """

    def __init__(
        self,
        workload: Workload,
        backend: Backend,
        scaling: ScalingConfig,
        *,
        failure_policy: FailurePolicy,
        drain_policy: DrainPolicy | None = None,
        hang_timeout_s: float | None = None,
        init_hook: Callable[[], None] | None = None,
        use_tqdm: bool = False,
        watch_drains: bool = True,
        termination_enabled: bool = False,
    ) -> None:
        self.workload = workload
        self.backend = backend
        self.scaling = scaling
        self.failure_policy = failure_policy
        self.drain_policy = drain_policy if drain_policy is not None else DrainPolicy(None)
        self.hang_timeout_s = hang_timeout_s
        self.init_hook = init_hook
        self.use_tqdm = use_tqdm
        self.group: WorkerGroup | None = None
        self.rendezvous: Rendezvous | None = None
        self.closed = False
        #: Workers of the next (or running) group: fewer than requested while elastic
        #: training runs shrunk.
        self.group_size = scaling.num_workers
        self.drain_watch = DrainWatch(enabled=watch_drains and not scaling.local_mode)
        #: A drain seen and not acted on yet.
        self.pending_drain: DrainEvent | None = None
        #: The driver's SIGTERM watch (the creator API's ``train()`` installs it).
        self.termination = TerminationWatch(enabled=termination_enabled)
        # A partial, not a method of self: the policy keeps no cycle to the loop.
        self.scaling_policy = ScalingPolicy(
            scaling, placeable=functools.partial(_placeable_off_draining, scaling, self.drain_watch)
        )
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------ the group
    @property
    def num_restarts(self) -> int:
        """Restarts after lost or hung workers so far."""
        return self.failure_policy.num_restarts

    @property
    def num_drains(self) -> int:
        """Drains the run moved off so far (not counted in :attr:`num_restarts`)."""
        return self.drain_policy.count

    def ensure_open(self) -> None:
        """Raise :class:`TrainerShutdownError` once the run is closed."""
        if self.closed:
            raise TrainerShutdownError(
                f"This {type(self.workload).__name__} is shut down; create a new one."
            )

    def start(self, num_workers: int | None = None) -> WorkerGroup:
        """Start a group of ``num_workers`` (default: :attr:`group_size`), connect it, set it up."""
        if num_workers is not None:
            self.group_size = num_workers
        rendezvous = self.backend.make_rendezvous()
        group = make_group(
            self.scaling,
            env_vars={**self.workload.worker_env(), **rendezvous.worker_env_vars()},
            num_workers=self.group_size,
            preload=self.backend.preload_modules,
            process_env=rendezvous.worker_process_env(),
        )
        try:
            group.start()
            self.group = group  # reachable (kill()) while it connects
            if self.init_hook is not None:
                group.execute(self.init_hook)  # before the workers connect
            rendezvous.on_start(group, self.workload.context(len(group)))
            self.workload.setup_workers(group)
        except BaseException:
            self.group = None
            shutdown_group(rendezvous, group)
            raise
        self.rendezvous = rendezvous
        self.drain_watch.watch(group.metadata)
        self.pending_drain = None  # Ray places nothing on a draining node: the group is clear
        # Release the actors even if the front end is dropped without a shutdown.
        self._finalizer = weakref.finalize(self, shutdown_group, rendezvous, group)
        self.workload.started()
        return group

    def teardown(self, force: bool = False) -> None:
        """Stop the current group (to the warm pool when healthy; ``force``: kill it)."""
        group, self.group = self.group, None
        rendezvous, self.rendezvous = self.rendezvous, None
        if group is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            shutdown_group(rendezvous, group, force)

    def restart(self, num_workers: int | None = None) -> None:
        """Start a fresh group and have the workload restore the latest state into it.

        ``num_workers`` None: the :class:`ScalingPolicy` sizes the group (with
        ``min_workers``, as many workers as the cluster holds now, off draining nodes).
        """
        self.workload.before_restart(planned=self.group is not None)
        self.teardown()
        self.start(num_workers or self.scaling_policy.restart_size())
        self.workload.restore()

    def close(self, force: bool = False) -> None:
        """Stop the group and end the run: later calls raise :class:`TrainerShutdownError`."""
        self.teardown(force=force)
        self.scaling_policy.release()  # an autoscaler may let the extra nodes go
        self.closed = True

    def share(self, value: Any) -> Any:
        """``value`` as one shared copy for every worker of the group (a checkpoint)."""
        return self.group.share(value) if self.group is not None else value

    # --------------------------------------------------------------- calls
    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
        max_retries: int | None = None,
        args_fn: Callable[[], tuple[Any, ...]] | None = None,
        per_rank: Callable[[int], tuple[Any, ...]] | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker (results in rank order); restart after a lost or hung worker.

        The :class:`FailurePolicy` decides: RETRY tears the group down, starts a new
        one, has the workload restore the latest state and runs the call again
        (``args_fn``, instead of ``args``, builds each attempt's arguments); RAISE
        closes the run and raises. ``max_retries`` gives this call its own budget of
        restarts (RaySGD's per-call option). A call the workload left for a drain
        (:class:`CallStoppedForDrain`) runs again off the node. ``per_rank(rank)``
        adds arguments of each rank's own.
        """
        restarts = 0
        while True:
            call_args = args_fn() if args_fn is not None else args
            try:
                return self.call_once(fn, *call_args, progress=progress, per_rank=per_rank)
            except CallStoppedForDrain as stopped:
                self.leave_drained_nodes(stopped.stop)
            except BaseException as exc:
                if self.failure_policy.decide(exc, max_retries, restarts) is FailureDecision.RAISE:
                    if isinstance(exc, self.failure_policy.retryable):
                        logger.error(
                            "%s; no restart left (%s=%s, %d used).",
                            describe_loss(exc),
                            self.failure_policy.option,
                            self.failure_policy.describe_limit(),
                            self.failure_policy.num_restarts,
                        )
                    self.close()
                    raise
                self._drain_became_loss(exc)
                self.failure_policy.record_restart(
                    exc, self.workload.restart_source(), max_retries, restarts
                )
                restarts += 1
                try:
                    self.restart()
                except BaseException:
                    self.closed = True
                    raise

    def call_once(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
        per_rank: Callable[[int], tuple[Any, ...]] | None = None,
    ) -> list[Any]:
        """Run ``fn`` once on every worker of the group (started first if there is none).

        A worker failure, a hang or Ctrl-C tears the whole group down before the
        error reaches the caller, so no worker is left blocked in a collective.
        """
        self.ensure_open()
        group = self.group if self.group is not None else self.start()
        if per_rank is None:
            submit = functools.partial(group.execute_async, fn, *args)
        else:
            submit = functools.partial(_submit_per_rank, group, fn, args, per_rank)
        if self.scaling.local_mode:  # the driver's own process: nothing to watch
            return self._guarded(lambda: group.get(submit()))
        bar = ProgressReporter(group, progress) if progress and self.use_tqdm else None
        watchdog = (
            HangWatchdog(group, self.hang_timeout_s) if self.hang_timeout_s is not None else None
        )
        pollers = [p.poll for p in (bar, watchdog) if p is not None] + self.workload.pollers()
        if self.drain_watch.enabled:
            pollers.append(self.poll_drains)

        def on_poll() -> None:
            for poll in pollers:
                poll()

        try:
            results = self._guarded(
                lambda: group.get(submit(), on_poll=on_poll, poll_interval_s=POLL_INTERVAL_S)
            )
        except BaseException:
            if bar:
                bar.close()
            raise
        if bar:
            bar.close(results[0] if isinstance(results[0], dict) else None)
        return results

    def _guarded(self, run: Callable[[], list[Any]]) -> list[Any]:
        """``run()``; on any error the workload's last words, then the group is torn down."""
        try:
            return run()
        except BaseException as exc:
            self.workload.after_failed_call(exc)
            self.teardown(force=self.workload.kill_failed_groups)
            raise

    # -------------------------------------------------------------- drains
    def poll_drains(self, force: bool = False) -> None:
        """Poll hook: note a drain of the group's nodes and tell the workload while it is pending.

        ``force`` looks at Ray's draining nodes now (the watch otherwise looks at
        most once a second).
        """
        event = self.drain_watch.poll(force=force)
        if event is not None:
            self.pending_drain = event.merged(self.pending_drain)
        if self.pending_drain is not None and self.group is not None:
            self.workload.on_drain(self.pending_drain, new=event is not None)

    def leave_drained_nodes(self, stop: DrainCheckpoint) -> None:
        """A call stopped for a drain at ``stop``: count it, then move off the node or stop.

        The :class:`DrainPolicy` decides. LeaveNodes: the group is killed (not
        kept warm: its workers on the node would come back), a new one starts with as
        many workers as fit elsewhere (elastic ``min_workers``), or waits for room
        (an autoscaler's replacement node) as any restart does, and the workload
        restores ``stop.path``.

        Raises:
            DrainLimitError: more drains than the limit; the run is closed, the
                checkpoint kept.
        """
        event, self.pending_drain = self.pending_drain, None
        decision = self.drain_policy.decide()
        nodes = ", ".join(event.node_ids) if event is not None else "(unknown)"
        deadline = event.deadline_note() if event is not None else "no deadline"
        held = (
            f"checkpoint {stop.path} holds {stop.where}" if stop.path else f"{stop.where} stopped"
        )
        logger.warning(
            "Drain %d (%s) of node %s: %s (%s).",
            decision.count,
            self.drain_policy.describe_limit(),
            nodes,
            held,
            deadline,
        )
        if isinstance(decision, StopRun):
            self.close(force=True)
            what = event.describe() if event is not None else "A node drains"
            held = f" Checkpoint {stop.path} holds {stop.where}:" if stop.path else ""
            raise DrainLimitError(
                f"{what}; that is drain {decision.count}, more than "
                f"{self.drain_policy.option}={decision.limit}.{held} {stop.resume}, or raise "
                f"{self.drain_policy.option.split()[-1]}.",
                checkpoint_path=stop.path,
            )
        self.teardown(force=True)  # not to the warm pool: those on the node would return
        try:
            self.restart()
        except BaseException:
            self.closed = True
            raise
        logger.warning(
            "Continuing %s on %d worker(s) off the drained node(s).",
            f"from {stop.path}" if stop.path else f"at {stop.where}",
            len(self.group) if self.group is not None else self.group_size,
        )

    def _drain_became_loss(self, error: BaseException) -> None:
        """A retried failure while a drain was pending: the node went first; it is a lost worker."""
        if self.pending_drain is None:
            return
        event, self.pending_drain = self.pending_drain, None
        logger.warning(
            "%s, and the group lost a worker before it stopped there (the node is gone): a "
            "restart from the latest state, as after any lost worker (%s=%s).",
            event.describe(),
            self.failure_policy.option,
            self.failure_policy.describe_limit(),
        )

    # ---------------------------------------------------- termination signal
    def stop_if_terminated(
        self,
        checkpoint: Callable[[], str | None],
        where: str,
        newest: Callable[[], str | None] = lambda: None,
    ) -> None:
        """At a boundary after the driver's termination signal: checkpoint here, then raise.

        ``checkpoint()`` writes a committed checkpoint at the position and returns its
        path (None: the write failed); ``where``: that position, for the messages;
        ``newest()``: the newest checkpoint kept, named when the write failed.

        Raises:
            TerminatedError: always, once a signal arrived (nothing when none did).
        """
        if not self.termination.requested():
            return
        name = self.termination.describe()
        logger.warning(
            "%s received: the workers checkpoint at %s, then training stops.", name, where
        )
        try:
            path = checkpoint()
        except Exception as exc:  # noqa: BLE001 (the process stops either way; say what is kept)
            logger.error("The checkpoint at the stop failed: %s", exc)
            path = None
        held = (
            f"checkpoint {path} holds {where}: no step lost"
            if path
            else f"the checkpoint at the stop failed; the newest one is {newest() or 'none'}"
        )
        raise TerminatedError(
            f"Training stopped on {name}: {held}. Run the same command with resume=True "
            f"(polytrain train --resume) to continue; exit with status "
            f"{TerminatedError.exit_code}.",
            checkpoint_path=path,
            signal_number=self.termination.received or 15,
        )
