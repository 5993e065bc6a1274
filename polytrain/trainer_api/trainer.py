"""The loop every trainer shares: options, the worker group's life, calls into it, checkpoints.

:class:`BaseTrainer` owns the driver's loop: start a worker group through the
backend's rendezvous, run worker functions on it, and on a failure ask the
policies (:mod:`polytrain.trainer_api.policies`) whether and at which size to
restart, resuming from the :class:`~polytrain.trainer_api.checkpointing.manager.CheckpointManager`'s
latest state. The framework trainers (:class:`~polytrain.trainer_api.torch.trainer.TorchTrainer`,
:class:`~polytrain.trainer_api.tensorflow.trainer.TFTrainer`) add only their framework
hooks: how workers are set up, and how a state leaves and enters them.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.registry import get_backend
from polytrain.errors import ConfigTypeError, PreemptedError, TrainerShutdownError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.factory import make_group
from polytrain.launchers.pool import warm_pool as pool
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.checkpointing.recovery import RecoveryStore
from polytrain.trainer_api.checkpointing.step_plans import StepCheckpointPlan
from polytrain.trainer_api.checkpointing.trainer_checkpoints import TrainerCheckpoints
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
    check_int,
    check_user_config,
    merge_flat_options,
)
from polytrain.trainer_api.policies import (
    FailurePolicy,
    HangWatchdog,
    ProgressReporter,
    ScalingPolicy,
)
from polytrain.trainer_api.policies.drain import (
    DrainDecision,
    DrainWatch,
    agree_on_stop,
    ask_workers,
    placeable_off_draining,
    preemption_limit,
)
from polytrain.trainer_api.policies.preemption import TerminationWatch
from polytrain.trainer_api.tracking import TrainerLoggers

logger = logging.getLogger(__name__)


def _shutdown_group(rendezvous: Rendezvous | None, group: WorkerGroup, force: bool = False) -> None:
    # Module-level (not a method): the finalizer that calls it must not keep the trainer alive.
    if force:
        # No clean-up call that could wait on a stuck worker, and no warm pool for
        # workers whose process groups were never torn down: kill them now.
        getattr(group, "terminate", group.shutdown)()
        return
    if rendezvous is not None:
        rendezvous.shutdown(group)  # never raises: dead workers are shut down too
    group.shutdown()


def _check_init_hook(init_hook: Any) -> Callable[[], None] | None:
    if init_hook is not None and not callable(init_hook):
        raise ConfigTypeError(
            f"init_hook must be a function of no arguments run on every worker; got "
            f"{type(init_hook).__name__}: {init_hook!r}."
        )
    return init_hook


class BaseTrainer(abc.ABC):
    """Shared driver logic: options, the worker group, retries, elastic size, checkpoints.

    Subclasses set ``framework``, call ``super().__init__`` and then
    :meth:`_start`, and implement :meth:`_setup_workers`, :meth:`_worker_state`
    and :meth:`_load_worker_state` (and :meth:`_file_state` if their state needs
    converting for a file).

    Args:
        backend: a backend name or alias, or a :class:`~polytrain.backends.Backend`.
        backend_config: the backend's typed config, or a dict of its fields.
        config: the user's hyperparameters; ``batch_size`` is the global batch. A dict,
            or an OmegaConf ``DictConfig`` (converted to one, interpolations resolved).
        num_workers: shortcut for ``scaling_config.num_workers``.
        use_gpu: shortcut for ``scaling_config.use_gpu``.
        num_cpus_per_worker: shortcut for ``scaling_config.num_cpus_per_worker``.
        scaling_config: :class:`ScalingConfig` or a dict of its fields. A shortcut
            may not set a field this sets too (see
            :func:`~polytrain.trainer_api.options.configs.merge_flat_options`).
        failure_config: :class:`FailureConfig` or a dict of its fields.
        checkpoint_config: :class:`CheckpointConfig` or a dict of its fields.
        use_fp16: mixed precision.
        use_tqdm: show rank 0's progress as a bar on the driver.
        init_hook: a function of no arguments run on every worker right after the
            group starts (and again after every restart), before the backend connects
            the workers and before the creators: environment variables, logging, a
            library's global settings.
        loggers: experiment trackers: Logger instances or names ("tensorboard",
            "mlflow", "wandb", "csv"); they receive the reduced metrics of every
            ``train()``/``validate()`` (see :mod:`polytrain.trainer_api.tracking`).

    Raises:
        ConfigError: an option that is not allowed (:class:`ConfigTypeError` for a
            wrong type or an unknown key).
    """

    framework: ClassVar[str] = "torch"
    #: The framework's worker-side checkpoint module (``load_dir(url) -> dict``), or None:
    #: the trainer cannot read checkpoint directories.
    checkpoint_worker_module: ClassVar[Any] = None
    #: Whether a running training call can stop after an agreed batch: then a draining
    #: node of the group is left at a step boundary (docs/failures.md, "Drained nodes");
    #: otherwise at the next call boundary (an epoch end for TFTrainer).
    stops_at_steps: ClassVar[bool] = False

    def __init__(
        self,
        *,
        backend: str | Backend,
        backend_config: Any = None,
        config: dict[str, Any] | None = None,
        num_workers: int | None = None,
        use_gpu: bool | None = None,
        num_cpus_per_worker: float | None = None,
        scaling_config: ScalingConfig | dict | None = None,
        failure_config: FailureConfig | dict | None = None,
        checkpoint_config: CheckpointConfig | dict | None = None,
        use_fp16: bool = False,
        use_tqdm: bool = False,
        init_hook: Callable[[], None] | None = None,
        loggers: Any = None,
    ) -> None:
        # First: shutdown() and the finalizer must work even if validation fails.
        self._group: WorkerGroup | None = None
        self._rendezvous: Rendezvous | None = None
        self._finalizer: weakref.finalize | None = None
        self._shut_down = False
        self.scaling = merge_flat_options(
            ScalingConfig,
            scaling_config,
            "scaling_config",
            num_workers=num_workers,
            use_gpu=use_gpu,
            num_cpus_per_worker=num_cpus_per_worker,
        )
        self.failure = merge_flat_options(FailureConfig, failure_config, "failure_config")
        self.checkpoint = merge_flat_options(
            CheckpointConfig, checkpoint_config, "checkpoint_config"
        )
        self.config = check_user_config(config)
        self.use_fp16 = bool(use_fp16)
        self.use_tqdm = bool(use_tqdm)
        self.backend = get_backend(backend, backend_config, framework=self.framework)
        self.backend.validate_settings(
            num_workers=self.scaling.num_workers,
            use_gpu=self.scaling.use_gpu,
            use_fp16=self.use_fp16,
        )
        self.init_hook = _check_init_hook(init_hook)
        #: The data position: the current epoch (counted from 0; the number of epochs
        #: completed) and the batches of it already trained.
        self.epoch = 0
        self._epoch_step = 0
        self._global_step = 0
        self._retries_requested = False
        self._group_size = self.scaling.num_workers
        self.failure_policy = FailurePolicy(self.failure.max_retries)
        self.scaling_policy = self._watch_drains()
        self.checkpoint_manager = CheckpointManager(self.checkpoint, keep_latest=self._keeps_state)
        # Mid-epoch checkpoints (torch trainers; TFTrainer's calls are whole epochs).
        self._step_plan = StepCheckpointPlan(self.checkpoint.every_n_steps, self.checkpoint.every_s)
        self.recovery = RecoveryStore(self.checkpoint, self.checkpoint_manager)
        #: Requests, recovery points, save and load (:mod:`.checkpointing.trainer_checkpoints`).
        self.checkpoints = TrainerCheckpoints(self)
        self._loggers = TrainerLoggers(loggers, log_dir=None)

    @classmethod
    def from_config(cls, path: str | Any, **overrides: Any) -> BaseTrainer:
        """Build a trainer from a YAML run config (see :mod:`polytrain.trainer_api.options.run_config`).

        ``path`` may also be the run config's keys as a dict or an OmegaConf
        ``DictConfig`` (a Hydra app's section). ``overrides`` use dotted keys for
        nested values, e.g. ``{"config.lr": 0.1}``.
        """
        from polytrain.trainer_api.options.run_config import trainer_from_config

        return trainer_from_config(path, trainer_cls=cls, **overrides)

    @classmethod
    def as_trainable(cls, **trainer_kwargs: Any) -> Any:
        """A Ray Tune trainable that builds this trainer for every trial (see :mod:`polytrain.tune`)."""
        from polytrain.trainer_api.trainable import make_trainable

        return make_trainable(cls, **trainer_kwargs)

    # ------------------------------------------------------------ properties
    @property
    def backend_name(self) -> str:
        """The canonical name of the backend in use."""
        return self.backend.name

    @property
    def num_workers(self) -> int:
        """Workers in the running group (fewer than requested while shrunk by elastic training)."""
        return self._group_size

    @property
    def num_restarts(self) -> int:
        """Restarts of the worker group after lost or hung workers so far."""
        return self.failure_policy.num_restarts

    @property
    def num_preemptions(self) -> int:
        """Drained nodes the group moved off so far (not counted in :attr:`num_restarts`)."""
        return self._preemptions

    @functools.cached_property
    def preemption(self) -> TerminationWatch:
        """SIGTERM during ``train()``: a checkpoint at the next boundary, then PreemptedError.

        Only with a ``checkpoint_dir`` (docs/failures.md).
        """
        return TerminationWatch(enabled=self.checkpoint.checkpoint_dir is not None)

    @property
    def _keeps_state(self) -> bool:
        """Whether epoch ends keep a state: for retries, elastic training or checkpoint files."""
        return (
            self.failure.max_retries > 0
            or self._retries_requested
            or self.checkpoint.checkpoint_dir is not None
            or self.scaling.min_workers is not None
        )

    # ------------------------------------------------------- framework hooks
    @abc.abstractmethod
    def _setup_workers(self, group: WorkerGroup) -> None:
        """Driver: build the framework's components in every worker of a new group."""

    @abc.abstractmethod
    def _worker_state(self) -> dict[str, Any]:
        """Driver: the training state from the workers, before :meth:`_wrap_state`."""

    @abc.abstractmethod
    def _load_worker_state(self, state: dict[str, Any]) -> None:
        """Driver: load a validated checkpoint dict into every worker."""

    def _file_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Driver: ``state`` as :meth:`save` writes it (default: unchanged)."""
        return state

    # ------------------------------------------------------------- lifecycle
    def _context_template(self) -> WorkerContext:
        """The context every worker of the current group starts from."""
        return WorkerContext.from_scaling(
            self.scaling,
            world_size=self._group_size,
            use_fp16=self.use_fp16,
            timeout_s=self.failure.collective_timeout_s,
            step=getattr(self, "step", None),  # TorchTrainer's StepOptions
        )

    def _start(self) -> None:
        """Start a worker group of ``_group_size``, connect it and set up every worker."""
        rendezvous = self.backend.make_rendezvous()
        group = make_group(
            self.scaling,
            env_vars=rendezvous.worker_env_vars(),
            num_workers=self._group_size,
            preload=self.backend.preload_modules,
        )
        try:
            group.start()
            if self.init_hook is not None:
                group.execute(self.init_hook)
            rendezvous.on_start(group, self._context_template())
            self._setup_workers(group)
        except BaseException:
            _shutdown_group(rendezvous, group)
            raise
        self._group, self._rendezvous = group, rendezvous
        self.drain_watch.watch(group.metadata)
        self._drain = None  # Ray places nothing on a draining node: the new group is clear of it
        # Release the actors even if the user never calls shutdown().
        self._finalizer = weakref.finalize(self, _shutdown_group, rendezvous, group)
        self.checkpoints.resume_if_requested()  # CheckpointConfig(resume=True): once, at the first start

    def _ensure_open(self) -> None:
        if self._shut_down:
            raise TrainerShutdownError(
                f"This {type(self).__name__} is shut down; create a new one."
            )

    def _poll_hooks(self) -> list[Callable[[], None]]:
        """Driver: more functions to call while a call runs (every 0.25 s; default: none)."""
        return []

    def _share(self, value: Any) -> Any:
        """``value`` as one shared copy for every worker of the group (a checkpoint)."""
        return self._group.share(value) if self._group is not None else value

    def _run_once(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker once and return the results in rank order.

        A worker failure tears the whole group down before the error reaches the
        caller, so no worker is left blocked in a collective. With
        ``hang_timeout_s`` set, a :class:`HangWatchdog` turns a group that stopped
        making progress into a :class:`~polytrain.errors.WorkerHangError`.
        """
        self._ensure_open()
        group = self._group
        if self.scaling.local_mode:
            return group.execute(fn, *args)
        bar = ProgressReporter(group, progress) if progress and self.use_tqdm else None
        watchdog = (
            HangWatchdog(group, self.failure.hang_timeout_s)
            if self.failure.hang_timeout_s is not None
            else None
        )
        pollers = [p.poll for p in (bar, watchdog) if p is not None] + self._poll_hooks()
        if self.drain_watch.enabled:
            pollers.append(self._poll_drains)

        def on_poll() -> None:
            for poll in pollers:
                poll()

        try:
            refs = group.execute_async(fn, *args)
            results = group.get(refs, on_poll=on_poll, poll_interval_s=0.25)
        except BaseException:
            # A worker error, a hang, or KeyboardInterrupt: stop every worker now.
            if bar:
                bar.close()
            self._teardown_group()
            raise
        finally:
            self._stoppable = None
        if bar:
            bar.close(results[0] if isinstance(results[0], dict) else None)
        return results

    def _run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
        max_retries: int | None = None,
        args_fn: Callable[[], tuple[Any, ...]] | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker (results in rank order), restarting the group after a lost or hung worker.

        The :class:`FailurePolicy` decides: a worker that died (killed, out of
        memory, node lost) or hung is replaced (the group is torn down, a new one
        starts, the latest recovery point is restored and the call is repeated)
        up to ``failure_config.max_retries`` restarts over the trainer's life, or
        ``max_retries`` restarts of this call when given. Anything else, an
        exception raised by user code above all, shuts the trainer down.
        ``args_fn`` (instead of ``args``) builds the arguments for every attempt:
        a repeated call starts from the restored position.
        """
        restarts = 0
        while True:
            call_args = args_fn() if args_fn is not None else args
            try:
                return self._run_once(fn, *call_args, progress=progress)
            except BaseException as exc:
                if not self.failure_policy.should_retry(exc, max_retries, restarts):
                    self._shut_down = True
                    raise
                restarts += 1
                self.failure_policy.record_restart(exc)
                self._restart()

    def _log(self, prefix: str, stats: dict[str, Any]) -> None:
        # The epoch the call's batches belonged to (trainer.epoch has already moved on
        # when the call ended an epoch); validation goes with the last trained epoch.
        if prefix == "train" and isinstance(stats.get("epoch"), int):
            self._logged_epoch = stats["epoch"]
        epoch = getattr(self, "_logged_epoch", self.epoch)
        self._loggers.log(prefix, stats, self._global_step, epoch, self._run_info)

    def _run_info(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "backend": self.backend.name,
            "num_workers": self.scaling.num_workers,
            "framework": self.framework,
        }

    # -------------------------------------------------- the data position
    def _restart(self, num_workers: int | None = None) -> None:
        """Start a fresh group and restore the latest recovery point into it.

        ``num_workers`` None: the :class:`ScalingPolicy` sizes the group (with
        ``min_workers``, as many workers as the cluster holds now). Without a
        recovery point the new workers start from the creators, at epoch 0.
        """
        # A planned restart (an elastic group growing back) first lets the workers
        # finish their background writes.
        if self._group is not None:
            self.checkpoints.flush()
        else:
            self.checkpoints.sync_recovery_point()
        self._teardown_group()
        self._group_size = num_workers or self.scaling_policy.restart_size()
        self._start()
        point = self.recovery.latest
        if point is None:
            self.epoch = self._epoch_step = 0
        elif point.state is not None:
            self.load_state_dict(point.state)
        else:
            self.checkpoints.load_recovery_file(point.path)
            self.epoch, self._epoch_step = point.epoch, point.epoch_step

    def _begin_call(self, max_retries: int | None = None) -> None:
        """Before a training call: note a per-call retry wish; at an epoch start, grow a shrunk group back.

        A node of the group that started draining since the last call is left first.
        """
        self._ensure_open()
        if self.drain_watch.enabled:
            self._poll_drains(force=True)
            self._leave_draining_nodes()
        if max_retries is not None:
            check_int("max_retries", max_retries, 0)
            if max_retries > 0 and not self._keeps_state:
                # From now on epoch ends keep a state; until the first one, restart from here.
                self._retries_requested = True
                if self.recovery.latest is None and (self.epoch or self._epoch_step):
                    self.recovery.remember_state(self.state_dict())
        if (
            self._epoch_step == 0
            and self.recovery.is_at(self.epoch, 0)
            and self.scaling_policy.should_grow(self._group_size)
        ):
            self._restart(self.scaling.num_workers)

    def _end_call(self, stats: dict[str, Any], cursor: dict[str, Any]) -> dict[str, Any]:
        """After a training call: move the data position, add restart and size stats."""
        if cursor["epoch_done"]:
            self.epoch, self._epoch_step = cursor["epoch"] + 1, 0
        else:
            self.epoch, self._epoch_step = cursor["epoch"], cursor["position"]
        self._global_step += int(stats.get("num_steps", 0) or 0)
        stats["epoch"] = cursor["epoch"]
        stats["num_restarts"] = self.num_restarts
        stats["num_workers"] = self.num_workers
        return stats

    def _stop_if_preempted(self) -> None:
        """At a boundary after a termination signal: checkpoint here, shut down, raise PreemptedError."""
        if not self.preemption.requested():
            return
        name = self.preemption.describe()
        logger.warning(
            "%s received: the workers checkpoint at epoch %d, batch %d, then training stops.",
            name,
            self.epoch,
            self._epoch_step,
        )
        try:
            path = self.checkpoints.checkpoint_here()
        except Exception as exc:  # noqa: BLE001 (the process stops either way; say what is kept)
            logger.error("The checkpoint at the stop failed: %s", exc)
            path = None
        kept = path or self.checkpoint_manager.latest_path
        self.shutdown()
        where = (
            f"checkpoint {path} holds epoch {self.epoch}, batch {self._epoch_step}: no step lost"
            if path
            else f"the checkpoint at the stop failed; the newest one is {kept or 'none'}"
        )
        raise PreemptedError(
            f"Training stopped on {name}: {where}. Run the same command with resume=True "
            f"(polytrain train --resume) to continue; exit with status "
            f"{PreemptedError.exit_code}.",
            checkpoint_path=path,
            signal_number=self.preemption.received or 15,
        )

    # ------------------------------------------------------- drained nodes
    def _watch_drains(self) -> ScalingPolicy:
        """Set up the drain watch; returns the scaling policy, which sizes groups without draining nodes."""
        #: Ray's draining nodes, read while training calls run (see :meth:`_poll_drains`).
        #: A trainer whose calls cannot stop at a step (TFTrainer's epoch calls) leaves a
        #: draining node at the next call boundary.
        self.drain_watch = DrainWatch(enabled=not self.scaling.local_mode)
        self._drain: DrainDecision | None = None  # a drain seen and not acted on yet
        self._stoppable: tuple[int, int] | None = None  # (call id, batches per step) running
        self._calls = 0
        self._preemptions = 0
        # A partial of the watch, not a method of self: the policy keeps no cycle to the trainer.
        return ScalingPolicy(
            self.scaling,
            placeable=functools.partial(placeable_off_draining, self.scaling, self.drain_watch),
        )

    def _open_stoppable_call(self, batches_per_step: int = 1) -> int | None:
        """Number the training call about to run, which a drain may stop after a step; None: not watched."""
        if not self.drain_watch.enabled:
            return None
        self._calls += 1
        self._stoppable = (self._calls, batches_per_step)
        return self._calls

    def _poll_drains(self, force: bool = False) -> None:
        """Poll hook: note a drain of the group's nodes; have a running training call stop at a step."""
        decision = self.drain_watch.poll(force=force)
        if decision is not None:
            logger.warning(
                "%s: the workers (%s) finish their current %s, checkpoint there and "
                "the group continues without the node.",
                decision.describe(),
                decision.describe_ranks(),
                "step" if self.stops_at_steps else "training call (an epoch)",
            )
            nodes = (self._drain.nodes if self._drain else ()) + decision.nodes
            self._drain = DrainDecision(nodes, decision.reason)
        if self._drain is None or self._stoppable is None or self._group is None:
            return
        (call_id, unit), self._stoppable = self._stoppable, None  # one agreement per call
        group = self._group
        target = agree_on_stop(lambda req: ask_workers(group, {**req, "call": call_id}), unit)
        if target is None:
            logger.warning(
                "The workers did not agree on a step to stop at; the call runs to its end, "
                "then the group moves off the draining node."
            )
        else:
            logger.info("Every worker stops after batch %d of the running call.", target)

    def _leave_draining_nodes(self) -> None:
        """At a step boundary after a drain: checkpoint here, count the preemption, restart off the node.

        The restarted group has as many workers as fit elsewhere (elastic
        ``min_workers``), else waits for room (an autoscaler's replacement node) as
        any restart does; it resumes at this very batch.

        Raises:
            PreemptedError: more drains than ``failure_config.max_preemptions``; the
                trainer is shut down after the checkpoint.
        """
        decision, self._drain = self._drain, None
        if decision is None or self._group is None:
            return
        self._preemptions += 1
        limit = self.failure.max_preemptions
        path = self._checkpoint_for_drain()
        where = f"epoch {self.epoch}, batch {self._epoch_step}"
        logger.warning(
            "Preemption %d (failure_config max_preemptions=%s) of node %s: checkpoint %s holds "
            "%s (%s).",
            self._preemptions,
            preemption_limit(limit),
            ", ".join(decision.node_ids),
            path or "(kept by the driver)",
            where,
            decision.deadline_note(),
        )
        if limit is not None and self._preemptions > limit:
            self.shutdown()
            raise PreemptedError(
                f"{decision.describe()}; that is preemption {self._preemptions}, more than "
                f"failure_config max_preemptions={limit}. Checkpoint {path} holds {where}: resume "
                f"from it (resume=True) or raise max_preemptions.",
                checkpoint_path=path,
            )
        self._teardown_group(force=True)  # not to the warm pool: those on the node would return
        try:
            self._restart()
        except BaseException:
            self._shut_down = True
            raise
        logger.warning(
            "Continuing at %s on %d worker(s) off the drained node(s).", where, self._group_size
        )

    def _checkpoint_for_drain(self) -> str | None:
        """A checkpoint at the current position as the recovery point; its path (None: held by the driver)."""
        start = time.perf_counter()
        path = (
            self.checkpoints.checkpoint_here() if self.checkpoints.workers_see_directory() else None
        )
        if path is None:  # workers on other nodes without shared storage: through the driver
            self.recovery.remember_state(self.state_dict())
        logger.info("Checkpoint at the drain written in %.1f s.", time.perf_counter() - start)
        return path

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The consolidated training state as a portable checkpoint dict."""
        return self.checkpoints.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or :meth:`save` on every worker.

        Any backend of the same framework and any world size may have written it.

        Raises:
            CheckpointError: not a checkpoint dict of this framework; nothing is loaded.
        """
        self.checkpoints.load_state_dict(state)

    def save(self, path: str | os.PathLike) -> str:
        """Write a consolidated checkpoint to ``path`` atomically; returns the absolute path."""
        return self.checkpoints.save(path)

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written under any backend or world size: a file from :meth:`save`, or a directory.

        A checkpoint directory (``checkpoint_dir``'s ``checkpoint_000003``, local or an
        fsspec URL) is validated on the driver first (commit marker, manifest, file
        sizes, framework), then every worker reads only the ranges it holds. A file
        is read with ``weights_only=True`` and validated before anything changes.

        Raises:
            CheckpointError: missing, truncated, uncommitted, corrupted, not a polytrain
                checkpoint, or written by a trainer of another framework; nothing is
                loaded then.
        """
        self.checkpoints.load(path)

    def follow_config(self, old: dict[str, Any]) -> None:
        """After a checkpoint written under a config with ``old`` values was loaded: follow ``config``.

        A checkpoint brings its optimizer hyperparameters back; a restore under a changed
        config (a PBT exploit) wants the new ones. Default: nothing to follow.
        """

    def apply_all_workers(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(*args)`` in every worker process; returns the results in rank order."""
        return self._run(fn, *args)

    # -------------------------------------------------------------- shutdown
    def _teardown_group(self, force: bool = False) -> None:
        group, self._group = self._group, None
        rendezvous, self._rendezvous = self._rendezvous, None
        if group is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            _shutdown_group(rendezvous, group, force)

    def shutdown(self, force: bool = False, release_workers: bool = False) -> None:
        """Stop the workers (a healthy group stays warm in the pool). Later calls raise.

        Args:
            force: kill the worker processes at once, without the backend's clean-up
                call on the workers (destroying process groups), which waits up to a
                few seconds for workers stuck in a collective. For a hung or broken
                group; the default shutdown is as quick for a healthy one.
            release_workers: give everything back now: this trainer's workers are
                stopped instead of kept warm (docs/warm-workers.md), and so is every idle
                group of the pool (:func:`polytrain.pool.clear`); returns once Ray shows
                their resources free (at most a few seconds).
        """
        if not force:
            self.checkpoints.flush()  # background checkpoint writes finish and commit
        self._teardown_group(force=force)
        if release_workers:  # the group went to the pool (or was stopped): cleared with the rest
            pool.POOL.clear(wait_s=5.0)
        self.scaling_policy.release()  # an autoscaler may let the extra nodes go
        self._shut_down = True
        self._loggers.finish()
        self.recovery.close()
        self.checkpoint_manager.close()

    def __enter__(self) -> BaseTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
