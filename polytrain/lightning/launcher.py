"""The Lightning launcher that runs a Trainer entry point on a polytrain worker group."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities import move_data_to_device
from pytorch_lightning.strategies.launchers.launcher import _Launcher
from pytorch_lightning.trainer.states import TrainerFn, TrainerState

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.core.torch_distributed import start_process_group
from polytrain.errors import PolytrainError, PreemptedError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.worker import STOP_HANDLER, WORKER_STATE
from polytrain.lightning import drains
from polytrain.lightning.restarts import (
    FIT_ENTRY,
    CheckpointFinder,
    ckpt_path_of,
    describe_loss,
    pin_logger_versions,
    should_restart,
    with_ckpt_path,
)
from polytrain.lightning.tune import TUNE_QUEUE_KEY, TuneReportCallback, deliver_report
from polytrain.trainer_api.policies.drain import DrainDecision, DrainWatch, preemption_limit
from polytrain.trainer_api.policies.failure import FailurePolicy

logger = logging.getLogger(__name__)


@dataclass
class _WorkerOutput:
    """What rank 0 sends back to the driver after a Trainer entry point ran."""

    trainer_state: TrainerState
    trainer_results: Any
    model_state: dict[str, Any] | None
    callback_metrics: dict[str, Any]
    logged_metrics: dict[str, Any]
    progress_bar_metrics: dict[str, Any]
    callback_states: list[dict[str, Any] | None]
    logger_versions: list[Any]
    loop_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class RayLauncher(_Launcher):
    """Runs a Trainer entry point (``_fit_impl``, ``_test_impl``, ...) on Ray actors.

    ``launch`` starts a worker group with :func:`~polytrain.launchers.factory.make_group`
    (the strategy's ``scaling``), lets the backend's rendezvous connect the workers
    (``on_start``), sends one pickled copy of the Trainer, the LightningModule and
    the call's arguments to every actor, runs the entry point there and copies
    rank 0's results into the driver's Trainer and LightningModule. The group is
    torn down after each call. A worker's exception reaches the driver with its
    rank and remote traceback; a lost worker starts a new group instead, within
    the strategy's ``max_retries`` (:mod:`polytrain.lightning.restarts`). While a call
    runs the launcher watches Ray's draining nodes: a ``fit`` whose node drains stops
    at a batch boundary, checkpoints there and continues in a new group off the node;
    other calls run again off it (:mod:`polytrain.lightning.drains`).

    Args:
        strategy: the :class:`~polytrain.lightning.RayStrategy` that owns this launcher.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._group: WorkerGroup | None = None
        # Driver-side drain state (never shipped to the workers, see __getstate__).
        self._drain_watch: DrainWatch | None = None
        self._drain: DrainDecision | None = None  # a drain of the running group's nodes
        self._drain_path: str | None = None  # where this attempt's fit checkpoints at a drain
        self._notice: Any = None  # rank 0's answer to the drain notice, pending
        self._notice_done = False

    @property
    def is_interactive_compatible(self) -> bool:
        """True: Ray actors start from notebooks (nothing is forked or re-run)."""
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every worker; return rank 0's result.

        A lost worker restarts the group, up to the strategy's ``max_retries`` over its
        life: a ``fit`` resumes from the newest checkpoint Lightning wrote during the
        call (see :mod:`polytrain.lightning.restarts`), other calls run again. A node of
        the group that drains is left, counted in ``num_preemptions`` (up to
        ``max_preemptions``): a ``fit`` stops at a batch boundary, checkpoints into
        ``<default_root_dir>/drain_checkpoints`` and continues from there in a new group
        (the file is removed once the fit completes); other calls run again.

        Raises:
            polytrain.errors.WorkerError: a worker raised (with its rank and traceback),
                or died once the restarts were spent.
            polytrain.errors.InsufficientResourcesError: the workers cannot be placed.
            polytrain.errors.PreemptedError: a drain past ``max_preemptions`` (with the
                checkpoint of a fit to resume from).
        """
        if trainer is None:
            raise TypeError(
                "RayLauncher.launch needs the Trainer (trainer=...): it runs Trainer entry "
                "points (fit, validate, test, predict) only."
            )
        # Actors may run in another directory (or on another node): ship absolute paths.
        _absolutize_paths(trainer)
        finder = self._prepare(trainer, function)
        tune_queue = _make_tune_queue(trainer)
        try:
            outputs, written = self._attempts(trainer, function, args, kwargs, tune_queue, finder)
        finally:
            self._drain_path = None
            if tune_queue is not None:
                tune_queue.shutdown()
        if self._drain is not None:
            logger.warning(
                "The %s call ended before it could stop for the drain (%s): nothing to move.",
                _call_name(function),
                self._drain.describe(),
            )
        for path in written:  # the fit completed: its drain checkpoints are spent
            drains.remove_checkpoint(path)
        output: _WorkerOutput = outputs[0]
        _recover_results_in_main_process(output, trainer)
        return output.trainer_results

    def _prepare(self, trainer: Any, function: Callable) -> CheckpointFinder | None:
        """Before a call's first group: the drain watch, pinned logger versions, the checkpoint finder."""
        if self._drain_watch is None:
            self._drain_watch = DrainWatch(enabled=not self._strategy.scaling.local_mode)
        if _name_of(function) != FIT_ENTRY:
            return None
        if self._strategy.max_retries > 0 or self._drain_watch.enabled:
            # Every group of this call must log and checkpoint into the same directories.
            pin_logger_versions(trainer)
        if self._strategy.max_retries == 0:
            return None
        return CheckpointFinder.for_trainer(
            trainer, extra=[drains.drain_directory(trainer.default_root_dir)]
        )

    def _attempts(
        self,
        trainer: Any,
        function: Callable,
        args: tuple,
        kwargs: dict[str, Any],
        tune_queue: Any,
        finder: CheckpointFinder | None,
    ) -> tuple[list[Any], list[str]]:
        """Run the call on groups until one completes: ``(outputs, drain checkpoints written)``.

        After a lost worker the call restarts (``max_retries``); after a drain a fit
        resumes from its drain checkpoint and another call runs again (``max_preemptions``).
        """
        watch = self._drain_watch
        stoppable = _name_of(function) == FIT_ENTRY and watch is not None and watch.enabled
        token, written, attempt = drains.new_token(), [], 0
        while True:
            attempt += 1
            self._drain_path = (
                drains.drain_checkpoint_path(trainer.default_root_dir, token, attempt)
                if stoppable
                else None
            )
            try:
                outputs = self._launch_once(trainer, function, args, kwargs, tune_queue)
            except _RunAgainOffNode:
                self._count_preemption(function, None)
                continue
            except BaseException as exc:
                args, kwargs = self._restart_or_raise(exc, function, args, kwargs, finder)
                continue
            stop = outputs[0] if outputs else None
            if not isinstance(stop, drains.DrainStopped):
                return outputs, written
            args, kwargs = self._move_off(stop, function, args, kwargs, written)

    def _launch_once(
        self,
        trainer: Any,
        function: Callable,
        args: tuple,
        kwargs: dict[str, Any],
        tune_queue: Any,
    ) -> list[_WorkerOutput | None]:
        """Start a group, connect it, run the entry point on it, tear it down (also on failure)."""
        from polytrain.launchers.factory import make_group  # imports Ray's side lazily

        strategy = self._strategy
        rendezvous = strategy.backend.make_rendezvous()
        group = make_group(
            strategy.scaling,
            env_vars=_worker_env_vars(rendezvous),
            preload=strategy.backend.preload_modules,
        )
        group.start()
        self._group = group
        self._watch(group)
        try:
            if strategy.init_hook is not None:
                group.execute(strategy.init_hook)  # before the workers connect
            ctx = strategy._context_template()
            rendezvous.on_start(group, ctx)
            _ensure_torch_process_group(group, ctx)
            return _run_on_group(
                group,
                trainer,
                function,
                args,
                kwargs,
                tune_queue,
                drain_path=self._drain_path,
                watch=functools.partial(self._poll_drains, group, function),
            )
        finally:
            self._group = None
            rendezvous.shutdown(group)  # never raises: shutdown goes on with dead workers
            if self._drain is not None:
                group.terminate()  # not to the warm pool: those on the node would come back
            else:
                group.shutdown()

    # ------------------------------------------------------------ drained nodes
    def _watch(self, group: WorkerGroup) -> None:
        """Watch the nodes of a group that just started (a draining node hosts none of it)."""
        self._drain, self._notice, self._notice_done = None, None, False
        if self._drain_watch is not None and self._drain_watch.enabled:
            self._drain_watch.watch(group.metadata)

    def _poll_drains(self, group: WorkerGroup, function: Callable | str) -> None:
        """Poll hook: a node of the group drains? Stop a fit at a batch; abort another call.

        Raises:
            _RunAgainOffNode: a validate/test/predict call (or a fit that cannot stop at
                a batch boundary) is left at once, to run again off the node.
        """
        watch = self._drain_watch
        if watch is None or not watch.enabled:
            return
        decision = watch.poll()
        if decision is not None:
            nodes = (self._drain.nodes if self._drain else ()) + decision.nodes
            self._drain = DrainDecision(nodes, decision.reason)
            ranks = decision.describe_ranks()
            if self._drain_path is None:
                logger.warning(
                    "%s: the workers (%s) stop the running %s call, which runs again off the node.",
                    decision.describe(),
                    ranks,
                    _call_name(function),
                )
                raise _RunAgainOffNode(decision)
            logger.warning(
                "%s: the workers (%s) finish their current batch, checkpoint there and the fit "
                "continues off the node.",
                decision.describe(),
                ranks,
            )
        if self._drain is not None and self._drain_path is not None and not self._notice_done:
            self._deliver_notice(group)

    def _deliver_notice(self, group: WorkerGroup) -> None:
        """Hand rank 0 the drain notice (again, until its fit has a handler to take it)."""
        if self._notice is None:
            self._notice = group.monitor_single_async(0, "stop_request", {"drain": True})
            return
        done, reply = group.poll(self._notice)
        if not done:
            return
        self._notice = None
        delivered, refusal = drains.notice_reply(reply)
        if not delivered:
            return  # rank 0 is not in its fit yet: the next poll sends it again
        self._notice_done = True
        if refusal is not None:
            logger.warning(
                "Rank 0 cannot stop this fit at a batch (%s): it runs on, and should the node "
                "go first the group restarts as after a lost worker (max_retries=%d).",
                refusal,
                self._strategy.max_retries,
            )

    def _count_preemption(self, function: Callable | str, stop: drains.DrainStopped | None) -> None:
        """Count a drain that stopped the call; past ``max_preemptions`` raise PreemptedError."""
        strategy = self._strategy
        strategy._num_preemptions += 1
        limit = strategy.max_preemptions
        decision = self._drain
        nodes = ", ".join(decision.node_ids) if decision is not None else "(unknown)"
        deadline = decision.deadline_note() if decision is not None else "no deadline"
        name = type(strategy).__name__
        if stop is not None:
            logger.warning(
                "Preemption %d (%s max_preemptions=%s) of node %s: checkpoint %s holds %s (%s).",
                strategy._num_preemptions,
                name,
                preemption_limit(limit),
                nodes,
                stop.checkpoint_path,
                stop.where(),
                deadline,
            )
        else:
            logger.warning(
                "Preemption %d (%s max_preemptions=%s) of node %s: the %s call stopped (%s).",
                strategy._num_preemptions,
                name,
                preemption_limit(limit),
                nodes,
                _call_name(function),
                deadline,
            )
        if limit is not None and strategy._num_preemptions > limit:
            what = decision.describe() if decision is not None else "A node drains"
            resume = (
                f"Checkpoint {stop.checkpoint_path} holds {stop.where()}: resume with "
                f"trainer.fit(model, ckpt_path={stop.checkpoint_path!r})"
                if stop is not None
                else f"Run the {_call_name(function)} call again"
            )
            raise PreemptedError(
                f"{what}; that is preemption {strategy._num_preemptions}, more than "
                f"{name}(max_preemptions={limit}). {resume}, or raise max_preemptions.",
                checkpoint_path=stop.checkpoint_path if stop is not None else None,
            )
        self._drain = None  # acted on; the next group starts off the node

    def _move_off(
        self,
        stop: drains.DrainStopped,
        function: Callable,
        args: tuple,
        kwargs: dict[str, Any],
        written: list[str],
    ) -> tuple[tuple, dict[str, Any]]:
        """A fit stopped at its drain checkpoint: count it; the next attempt resumes from there."""
        path = stop.checkpoint_path
        if path is None or ("://" not in path and not os.path.isfile(path)):
            raise PreemptedError(
                f"The fit stopped for a drain at {stop.where()}, but its checkpoint "
                f"{path} is not visible to the driver: give the Trainer a default_root_dir "
                f"on storage the driver and every worker share.",
                checkpoint_path=path,
            )
        for older in written:  # superseded by the newer one
            drains.remove_checkpoint(older)
        written[:] = [path]
        self._count_preemption(function, stop)
        logger.warning(
            "Continuing the fit from %s on %d worker(s) off the drained node(s).",
            path,
            self._strategy.num_workers,
        )
        return with_ckpt_path(function, args, kwargs, path)

    def _restart_or_raise(
        self,
        error: BaseException,
        function: Callable,
        args: tuple,
        kwargs: dict[str, Any],
        finder: CheckpointFinder | None,
    ) -> tuple[tuple, dict[str, Any]]:
        """After a failed attempt: the next attempt's arguments, or ``error`` raised again.

        A lost worker within the strategy's ``max_retries`` counts a restart; a fit's
        next attempt resumes from the newest checkpoint of the call, if there is one.
        """
        strategy = self._strategy
        if self._drain is not None and isinstance(error, FailurePolicy.retryable):
            logger.warning(
                "%s, and the group lost a worker before it stopped there (the node is gone): "
                "a lost worker, handled by max_retries.",
                self._drain.describe(),
            )
            self._drain = None
        if not should_restart(error, strategy._num_restarts, strategy.max_retries):
            if isinstance(error, FailurePolicy.retryable):
                logger.error(
                    "%s; no restart left (max_retries=%d, %d used).",
                    describe_loss(error),
                    strategy.max_retries,
                    strategy._num_restarts,
                )
            raise error
        strategy._num_restarts += 1
        if finder is None:
            source = f"the start of the {_call_name(function)} call"
        elif (path := finder.newest()) is not None:
            args, kwargs = with_ckpt_path(function, args, kwargs, path)
            source = path
        else:
            given = ckpt_path_of(function, args, kwargs)
            start = f"ckpt_path={given!r}" if given else "the start of the fit"
            source = f"{start} ({finder.describe_none()})"
        logger.warning(
            "%s; restart %d of %d from %s.",
            describe_loss(error),
            strategy._num_restarts,
            strategy.max_retries,
            source,
        )
        return args, kwargs

    def kill(self, signum: Any) -> None:
        """Stop the workers now (Lightning calls this on a second Ctrl+C)."""
        group = self._group
        if group is not None:
            group.shutdown()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_group"] = None  # actor handles stay with the driver
        state["_drain_watch"] = state["_drain"] = state["_notice"] = None
        return state


class _RunAgainOffNode(PolytrainError):
    """Raised by the poll hook to leave a call that a drain ends (it runs again off the node)."""

    def __init__(self, decision: DrainDecision) -> None:
        super().__init__(decision.describe())
        self.decision = decision


def _name_of(function: Callable | str) -> str:
    return function if isinstance(function, str) else getattr(function, "__name__", "")


def _call_name(function: Callable | str) -> str:
    """``fit``, ``validate``, ... for the Trainer entry point ``function``."""
    return _name_of(function).strip("_").removesuffix("_impl")


def _worker_env_vars(rendezvous: Rendezvous) -> dict[str, str]:
    # Lightning's seed_everything() records the seed in PL_* variables; the workers
    # re-seed from them (reset_seed) like processes that Lightning starts itself.
    env = {k: v for k, v in os.environ.items() if k.startswith("PL_")}
    env.update(rendezvous.worker_env_vars())
    return env


def _run_on_group(
    group: WorkerGroup,
    trainer: Any,
    function: Callable | str,
    args: tuple,
    kwargs: dict[str, Any],
    tune_queue: Any,
    drain_path: str | None = None,
    watch: Callable[[], None] | None = None,
) -> list[Any]:
    """Run the entry point on every worker, forwarding Tune reports and watching drains while waiting.

    ``drain_path``: where a fit checkpoints when a drain stops it (None: not stoppable);
    ``watch``: the drain poll, called while waiting.
    """
    import ray

    # A bound Trainer method travels as its name: the Trainer copy inside the
    # payload is the one it must run on.
    if getattr(function, "__self__", None) is trainer:
        function = function.__name__
    payload = ray.put((trainer, function, args, kwargs))  # once for all workers
    refs = [
        group.execute_single_async(
            rank, _run_on_worker, payload, info, device, os.getcwd(), tune_queue, drain_path
        )
        for rank, (info, device) in enumerate(
            zip(group.rank_infos, group.device_indices, strict=True)
        )
    ]
    polls = [p for p in (watch,) if p is not None]
    if tune_queue is not None:
        polls.append(lambda: _forward_tune_reports(tune_queue))

    def poll() -> None:
        for each in polls:
            each()

    try:
        return group.get(refs, on_poll=poll if polls else None, poll_interval_s=0.2)
    finally:
        # Also when a worker failed: what rank 0 reported before (the checkpoint a
        # restored trial resumes from) must reach Tune before the error does.
        if tune_queue is not None:
            _forward_tune_reports(tune_queue)


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


def _to_cpu(data: Any) -> Any:
    return move_data_to_device(data, torch.device("cpu"))


def _run_on_worker(
    payload: tuple[Any, Any, tuple, dict],
    rank_info: Any,
    device_index: int,
    cwd: str,
    tune_queue: Any,
    drain_path: str | None = None,
) -> _WorkerOutput | drains.DrainStopped | None:
    """Worker: run the Trainer entry point on this worker's copy of the Trainer.

    With ``drain_path`` (a fit the driver may stop for a drain) the fit stops when rank 0
    is told, on every rank at the same batch boundary, checkpoints to ``drain_path`` and
    returns :class:`~polytrain.lightning.drains.DrainStopped`.
    """
    trainer, function, args, kwargs = payload
    try:
        os.chdir(cwd)  # relative paths in the user's code mean what they mean on the driver
    except OSError:
        pass  # another node without that directory: absolute paths were shipped
    # Set or cleared on every call: a reused (warm) actor may hold an earlier run's queue.
    if tune_queue is not None:
        WORKER_STATE[TUNE_QUEUE_KEY] = tune_queue
    else:
        WORKER_STATE.pop(TUNE_QUEUE_KEY, None)
    strategy = trainer.strategy
    strategy._set_worker_context(rank_info, device_index)
    if isinstance(function, str):
        function = getattr(trainer, function)
    if drain_path is None or _name_of(function) != FIT_ENTRY:
        WORKER_STATE.pop(STOP_HANDLER, None)
        strategy._loader_positions = None
        results = function(*args, **kwargs)
    else:
        world_size = strategy._worker.ctx.world_size
        notice = drains.DrainNotice()
        notice.refusal = drains.install_stop(trainer, notice, world_size)
        strategy._loader_positions = drains.ResumableLoaders(world_size)
        trainer.callbacks.append(strategy._loader_positions)  # after the driver's: they zip
        WORKER_STATE[STOP_HANDLER] = notice
        try:
            results = function(*args, **kwargs)
        except drains.DrainStop:
            return drains.stop_at_drain(trainer, drain_path)
        finally:
            WORKER_STATE.pop(STOP_HANDLER, None)
    if rank_info.world_rank != 0:
        return None
    fitting = trainer.state.fn == TrainerFn.FITTING
    return _WorkerOutput(
        trainer_state=trainer.state,
        trainer_results=_to_cpu(results),
        model_state=_to_cpu(strategy._final_model_state) if fitting else None,
        callback_metrics=_to_cpu(dict(trainer.callback_metrics)),
        logged_metrics=_to_cpu(dict(trainer.logged_metrics)),
        progress_bar_metrics=_to_cpu(dict(trainer.progress_bar_metrics)),
        callback_states=[_to_cpu(_callback_state(cb)) for cb in trainer.callbacks],
        logger_versions=[getattr(lg, "version", None) for lg in trainer.loggers],
        loop_state=_to_cpu(trainer.fit_loop.state_dict()) if fitting else None,
    )


def _callback_state(callback: Any) -> dict[str, Any] | None:
    try:
        state = callback.state_dict()
    except Exception:  # noqa: BLE001 - a user callback whose state does not serialise
        return None
    if hasattr(callback, "dirpath"):
        state = {**state, "dirpath": callback.dirpath}
    return state


def _recover_results_in_main_process(output: _WorkerOutput, trainer: Any) -> None:
    """Driver: copy rank 0's weights, metrics, callback and loop state into the Trainer."""
    if output.model_state is not None:
        module = trainer.lightning_module
        # Non-strict like Lightning's spawn launcher: configure_model/setup may have
        # added layers on the workers that the driver's module never built.
        missing, unexpected = module.load_state_dict(output.model_state, strict=False)
        if missing or unexpected:
            logger.warning(
                "Loading the workers' weights into the driver's module: missing keys %s, "
                "unexpected keys %s.",
                missing,
                unexpected,
            )
    trainer.state = output.trainer_state
    trainer.callback_metrics.update(output.callback_metrics)
    trainer.logged_metrics.update(output.logged_metrics)
    trainer.progress_bar_metrics.update(output.progress_bar_metrics)
    for callback, state in zip(trainer.callbacks, output.callback_states, strict=False):
        if not state:
            continue
        if "dirpath" in state and hasattr(callback, "dirpath"):
            callback.dirpath = state["dirpath"]
        try:
            callback.load_state_dict(state)
        except Exception:  # noqa: BLE001 - keep the run's result even if one callback differs
            logger.warning("Could not restore the state of callback %r", callback, exc_info=True)
    for lg, version in zip(trainer.loggers, output.logger_versions, strict=False):
        if version is not None and hasattr(lg, "_version"):
            lg._version = version
    if output.loop_state is not None:
        trainer.fit_loop.load_state_dict(output.loop_state)
