"""What every creator-API trainer shares: options, the data position, checkpoints, and its run loop.

A :class:`BaseTrainer` is the creator API's state (options, the data position,
checkpoints, loggers); its worker groups live in a
:class:`~polytrain.runs.loop.RunLoop`, the one driver loop under every front end,
which starts them, runs calls, watches them and acts on the policies' decisions
(restart, resize, leave a draining node, stop). The trainer is the loop's
:class:`~polytrain.runs.workload.Workload`: it says how a new group's workers are
set up and how a restarted group gets its state back. The framework trainers
(:class:`~polytrain.trainer_api.torch.trainer.TorchTrainer`,
:class:`~polytrain.trainer_api.tensorflow.trainer.TFTrainer`) add only their framework
hooks: how workers are set up, and how a state leaves and enters them.
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.compat.deprecation import DRAIN_WORD, renamed
from polytrain.errors import ConfigTypeError, RunStoppedError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.pool import warm_pool as pool
from polytrain.runs.loop import RunLoop
from polytrain.runs.policies.drain import DrainPolicy
from polytrain.runs.policies.failure import FailurePolicy
from polytrain.runs.stop_at_step import agree_on_stop, ask_workers
from polytrain.runs.watch.drains import DrainEvent
from polytrain.runs.watch.termination import TerminationWatch
from polytrain.runs.workload import DrainCheckpoint, Workload
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.checkpointing.recovery import RecoveryStore
from polytrain.trainer_api.checkpointing.step_plans import StepCheckpointPlan
from polytrain.trainer_api.checkpointing.trainer_checkpoints import (
    TrainerCheckpoints,
    WorkerStates,
)
from polytrain.trainer_api.data.position import DataPosition
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
    check_int,
    check_user_config,
    merge_flat_options,
)
from polytrain.trainer_api.tracking import TrainerLoggers

logger = logging.getLogger(__name__)


def _check_init_hook(init_hook: Any) -> Callable[[], None] | None:
    if init_hook is not None and not callable(init_hook):
        raise ConfigTypeError(
            f"init_hook must be a function of no arguments run on every worker; got "
            f"{type(init_hook).__name__}: {init_hook!r}."
        )
    return init_hook


class BaseTrainer(Workload, abc.ABC):
    """Shared driver logic: options, the data position, checkpoints; the run loop does the rest.

    Subclasses set ``framework``, call ``super().__init__`` and then
    :meth:`_start`, and implement :meth:`setup_workers`, :meth:`_worker_state`
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
        #: The data position: epoch, batches into it, optimizer steps (what checkpoints hold).
        self.position = DataPosition()
        self._retries_requested = False
        #: The worker groups and everything that happens to them (:mod:`polytrain.runs.loop`).
        self.loop = RunLoop(
            self,
            self.backend,
            self.scaling,
            failure_policy=FailurePolicy(self.failure.max_retries),
            drain_policy=DrainPolicy(self.failure.max_drains, "failure_config max_drains"),
            hang_timeout_s=self.failure.hang_timeout_s,
            init_hook=self.init_hook,
            use_tqdm=self.use_tqdm,
            # SIGTERM is only caught with somewhere to keep the state a later run resumes from.
            termination_enabled=self.checkpoint.checkpoint_dir is not None,
        )
        self._stoppable: tuple[int, int] | None = None  # (call id, batches per step) running
        self._calls = 0
        self._make_checkpoints()
        self._loggers = TrainerLoggers(loggers, log_dir=None)

    def _make_checkpoints(self) -> None:
        """The checkpoint manager, the mid-epoch plan, the recovery store and their front object."""
        self.checkpoint_manager = CheckpointManager(self.checkpoint, keep_latest=self._keeps_state)
        # Mid-epoch checkpoints (torch trainers; TFTrainer's calls are whole epochs).
        self._step_plan = StepCheckpointPlan(self.checkpoint.every_n_steps, self.checkpoint.every_s)
        self.recovery = RecoveryStore(self.checkpoint, self.checkpoint_manager)
        #: Requests, recovery points, save and load (:mod:`.checkpointing.trainer_checkpoints`).
        self.checkpoints = TrainerCheckpoints(
            loop=self.loop,
            states=WorkerStates(
                framework=self.framework,
                backend_name=self.backend.name,
                worker_module=self.checkpoint_worker_module,
                gather=self._worker_state,
                scatter=self._load_worker_state,
                for_file=self._file_state,
            ),
            position=self.position,
            manager=self.checkpoint_manager,
            recovery=self.recovery,
            config=self.checkpoint,
            max_failures=self.failure.max_checkpoint_failures,
            keeps_state=lambda: self._keeps_state,
        )

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
        return self.loop.group_size

    @property
    def num_restarts(self) -> int:
        """Restarts of the worker group after lost or hung workers so far."""
        return self.loop.num_restarts

    @property
    def num_drains(self) -> int:
        """Drained nodes the group moved off so far (not counted in :attr:`num_restarts`)."""
        return self.loop.num_drains

    @property
    def num_preemptions(self) -> int:
        """Deprecated name of :attr:`num_drains`."""
        renamed("num_preemptions", "num_drains", DRAIN_WORD)
        return self.num_drains

    @property
    def termination(self) -> TerminationWatch:
        """The driver's SIGTERM during ``train()``: a checkpoint at the next boundary, then TerminatedError.

        Only with a ``checkpoint_dir`` (docs/failures.md).
        """
        return self.loop.termination

    @property
    def preemption(self) -> TerminationWatch:
        """Deprecated name of :attr:`termination`."""
        renamed("trainer.preemption", "trainer.termination", "the driver's SIGTERM watch")
        return self.termination

    @property
    def epoch(self) -> int:
        """The current epoch, counted from 0: the number of epochs completed."""
        return self.position.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.position.epoch = value

    @property
    def _group(self) -> WorkerGroup | None:
        return self.loop.group

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
    def _worker_state(self) -> dict[str, Any]:
        """Driver: the training state from the workers, before it is wrapped as a checkpoint."""

    @abc.abstractmethod
    def _load_worker_state(self, state: dict[str, Any]) -> None:
        """Driver: load a validated checkpoint dict into every worker."""

    def _file_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Driver: ``state`` as :meth:`save` writes it (default: unchanged)."""
        return state

    # ------------------------------------------------ run loop hooks (Workload)
    def context(self, world_size: int) -> WorkerContext:
        """Run loop: the context every worker of a new group starts from."""
        return WorkerContext.from_scaling(
            self.scaling,
            world_size=world_size,
            use_fp16=self.use_fp16,
            timeout_s=self.failure.collective_timeout_s,
            step=getattr(self, "step", None),  # TorchTrainer's StepOptions
        )

    def _context_template(self) -> WorkerContext:
        return self.context(self.loop.group_size)

    def started(self) -> None:
        """Run loop: a group started; ``CheckpointConfig(resume=True)`` loads once, at the first."""
        self.checkpoints.resume_if_requested()

    def before_restart(self, planned: bool) -> None:
        """Run loop: a planned restart lets the workers finish their background writes first."""
        if planned:
            self.checkpoints.flush()
        else:
            self.checkpoints.sync_recovery_point()

    def restore(self) -> None:
        """Run loop: load the latest recovery point into the restarted group (none: epoch 0)."""
        point = self.recovery.latest
        if point is None:
            self.position.epoch = self.position.epoch_step = 0
        elif point.state is not None:
            self.load_state_dict(point.state)
        else:
            self.checkpoints.load_recovery_file(point.path)
            self.position.epoch, self.position.epoch_step = point.epoch, point.epoch_step

    def on_drain(self, event: DrainEvent, new: bool) -> None:
        """Run loop: say what happens to the running call, and have it stop at an agreed step."""
        if new:
            logger.warning(
                "%s: the workers (%s) finish their current %s, checkpoint there and "
                "the group continues without the node.",
                event.describe(),
                event.describe_ranks(),
                "step" if self.stops_at_steps else "training call (an epoch)",
            )
        if self._stoppable is None or self.loop.group is None:
            return
        (call_id, unit), self._stoppable = self._stoppable, None  # one agreement per call
        group = self.loop.group
        target = agree_on_stop(lambda req: ask_workers(group, {**req, "call": call_id}), unit)
        if target is None:
            logger.warning(
                "The workers did not agree on a step to stop at; the call runs to its end, "
                "then the group moves off the draining node."
            )
        else:
            logger.info("Every worker stops after batch %d of the running call.", target)

    # ------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        """Start the first worker group (the run loop connects it and calls :meth:`setup_workers`)."""
        self.loop.start()

    def _ensure_open(self) -> None:
        self.loop.ensure_open()

    def _share(self, value: Any) -> Any:
        """``value`` as one shared copy for every worker of the group (a checkpoint)."""
        return self.loop.share(value)

    def _run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
        max_retries: int | None = None,
        args_fn: Callable[[], tuple[Any, ...]] | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker through the run loop (results in rank order).

        A lost or hung worker restarts the group from the latest recovery point and
        repeats the call, up to ``failure_config.max_retries`` restarts over the
        trainer's life, or ``max_retries`` restarts of this call when given;
        anything else, an exception raised by user code above all, shuts the
        trainer down. ``args_fn`` (instead of ``args``) builds the arguments for
        every attempt: a repeated call starts from the restored position.
        """
        try:
            return self.loop.call(
                fn, *args, progress=progress, max_retries=max_retries, args_fn=args_fn
            )
        finally:
            self._stoppable = None

    def _log(self, prefix: str, stats: dict[str, Any]) -> None:
        # The epoch the call's batches belonged to (trainer.epoch has already moved on
        # when the call ended an epoch); validation goes with the last trained epoch.
        if prefix == "train" and isinstance(stats.get("epoch"), int):
            self._logged_epoch = stats["epoch"]
        epoch = getattr(self, "_logged_epoch", self.epoch)
        self._loggers.log(prefix, stats, self.position.global_step, epoch, self._run_info)

    def _run_info(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "backend": self.backend.name,
            "num_workers": self.scaling.num_workers,
            "framework": self.framework,
        }

    # -------------------------------------------------- the data position
    def _begin_call(self, max_retries: int | None = None) -> None:
        """Before a training call: note a per-call retry wish; at an epoch start, grow a shrunk group back.

        A node of the group that started draining since the last call is left first.
        """
        self._ensure_open()
        if self.loop.drain_watch.enabled:
            self.loop.poll_drains(force=True)
            self._leave_drained_nodes()
        if max_retries is not None:
            check_int("max_retries", max_retries, 0)
            if max_retries > 0 and not self._keeps_state:
                # From now on epoch ends keep a state; until the first one, restart from here.
                self._retries_requested = True
                position = self.position
                if self.recovery.latest is None and (position.epoch or position.epoch_step):
                    self.recovery.remember_state(self.state_dict())
        if (
            self.position.epoch_step == 0
            and self.recovery.is_at(self.epoch, 0)
            and self.loop.scaling_policy.should_grow(self.loop.group_size)
        ):
            self.loop.restart(self.scaling.num_workers)

    def _end_call(self, stats: dict[str, Any], cursor: dict[str, Any]) -> dict[str, Any]:
        """After a training call: move the data position, add restart and size stats."""
        position = self.position
        if cursor["epoch_done"]:
            position.epoch, position.epoch_step = cursor["epoch"] + 1, 0
        else:
            position.epoch, position.epoch_step = cursor["epoch"], cursor["position"]
        position.global_step += int(stats.get("num_steps", 0) or 0)
        stats["epoch"] = cursor["epoch"]
        stats["num_restarts"] = self.num_restarts
        stats["num_workers"] = self.num_workers
        return stats

    def _stop_if_terminated(self) -> None:
        """At a boundary after the driver's SIGTERM: checkpoint here, shut down, raise TerminatedError."""
        try:
            self.loop.stop_if_terminated(
                self.checkpoints.checkpoint_here,
                self.position.describe(),
                newest=lambda: self.checkpoint_manager.latest_path,
            )
        except RunStoppedError:
            self.shutdown()
            raise

    # ------------------------------------------------------- drained nodes
    def _open_stoppable_call(self, batches_per_step: int = 1) -> int | None:
        """Number the training call about to run, which a drain may stop after a step; None: not watched."""
        if not self.loop.drain_watch.enabled:
            return None
        self._calls += 1
        self._stoppable = (self._calls, batches_per_step)
        return self._calls

    def _leave_drained_nodes(self) -> None:
        """At a step boundary after a drain: checkpoint here; the run loop moves the group off the node.

        The restarted group has as many workers as fit elsewhere (elastic
        ``min_workers``), else waits for room (an autoscaler's replacement node) as
        any restart does; it resumes at this very batch.

        Raises:
            DrainLimitError: more drains than ``failure_config.max_drains``; the
                trainer is shut down after the checkpoint.
        """
        if self.loop.pending_drain is None or self.loop.group is None:
            return
        stop = DrainCheckpoint(
            path=self._checkpoint_for_drain(),
            where=self.position.describe(),
            resume="Resume from it (resume=True)",
        )
        try:
            self.loop.leave_drained_nodes(stop)
        except RunStoppedError:
            self.shutdown()
            raise

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
        loop = getattr(self, "loop", None)
        if loop is None:  # the constructor failed before the run loop existed
            return
        if not force:
            self.checkpoints.flush()  # background checkpoint writes finish and commit
        loop.close(force=force)
        if release_workers:  # the group went to the pool (or was stopped): cleared with the rest
            pool.POOL.clear(wait_s=5.0)
        self._loggers.finish()
        self.recovery.close()
        self.checkpoint_manager.close()

    def __enter__(self) -> BaseTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
