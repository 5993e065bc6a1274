"""The driver of the function API: run ``train_loop_per_worker`` on a worker group, restart it.

:class:`DataParallelTrainer` has Ray Train's shape (``fit() -> Result``). It runs on
polytrain's own machinery: a :class:`_LoopRunner` (a
:class:`~polytrain.trainer_api.trainer.BaseTrainer`) starts the worker group with
``make_group`` (warm pool included), connects it with the backend's rendezvous
(process group, Horovod, ...), and restarts it after a lost or hung worker as
``FailureConfig.max_failures`` allows; each restart runs the loop again, where
``get_checkpoint()`` returns the latest committed checkpoint. While the loop runs
the driver watches Ray's draining nodes: a drain of a node of the group reaches the
loop through ``get_preemption_info()``, and at the checkpoint the loop reports then,
the group moves off the node (:mod:`polytrain.train.preemption`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import inspect
import logging
from collections.abc import Callable
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.checkpoint.storage import Storage
from polytrain.compat.deprecation import DRAIN_WORD, renamed
from polytrain.errors import ConfigTypeError
from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.torchrun import torchrun_world
from polytrain.runs.loop import RunLoop
from polytrain.runs.policies.drain import DrainPolicy
from polytrain.runs.watch.drains import DrainEvent
from polytrain.runs.workload import DrainCheckpoint, Workload
from polytrain.train import worker_entry
from polytrain.train.board import ReportBoard
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.config import RunConfig, ScalingConfig, coerce, coerce_scaling
from polytrain.train.extras import RunExtras, refuse_restore
from polytrain.train.feed import ReportFeed, Sink, TrackerSink
from polytrain.train.local import fit_under_torchrun
from polytrain.train.preemption import LoopStopped, PreemptionInfo
from polytrain.train.result import Result

logger = logging.getLogger(__name__)


def check_loop(fn: Any, config: dict[str, Any] | None) -> bool:
    """Driver: whether ``fn`` takes the config (one argument) or nothing.

    Raises:
        ConfigTypeError: not callable, or a signature that takes neither.
    """
    if not callable(fn):
        raise ConfigTypeError(
            f"train_loop_per_worker must be a function of no arguments or of one (the config); "
            f"got {type(fn).__name__}: {fn!r}."
        )
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return config is not None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > 1 or required_kw or (not positional and not varargs and config):
        raise ConfigTypeError(
            f"train_loop_per_worker {getattr(fn, '__name__', fn)}{inspect.signature(fn)} must "
            f"take no arguments or exactly one (the train_loop_config dict)"
            + (f"; train_loop_config={config!r} needs one" if config else "")
            + ". Define it as `def train_loop_per_worker(config):`."
        )
    return bool(positional or varargs) and (config is not None or bool(required))


class _LoopRunner(Workload):
    """One ``fit()`` on the run loop: what the workers run, and drains told through the report board.

    A drained node of the group is left at the checkpoint the loop reports once told
    (every rank stops at that report), not at a call boundary.
    """

    framework = "torch"

    def __init__(self, owner: DataParallelTrainer) -> None:
        self.owner = owner
        self._announced: PreemptionInfo | None = None  # the drain the running loop was told of
        failure = owner.run_config.failure_config
        self.failure = failure.to_polytrain()
        self.scaling = owner.scaling_config
        self.use_fp16 = owner.use_fp16
        backend = get_backend(owner.backend, owner.backend_config, framework=self.framework)
        self.backend = owner.extras.backend(backend)  # a custom BackendConfig's hooks
        self.backend.validate_settings(
            num_workers=self.scaling.num_workers,
            use_gpu=self.scaling.use_gpu,
            use_fp16=self.use_fp16,
        )
        self.loop = RunLoop(
            self,
            self.backend,
            self.scaling,
            failure_policy=owner.extras.failure_policy(self.failure.max_retries),  # Ray's rule
            drain_policy=DrainPolicy(
                self.failure.max_drains, "FailureConfig max_preemption_failures"
            ),
            hang_timeout_s=self.failure.hang_timeout_s,
        )
        self.loop.start()

    @property
    def num_workers(self) -> int:
        """Workers of the running group (elastic: maybe fewer than asked)."""
        return self.loop.group_size

    def context(self, world_size: int) -> WorkerContext:
        """Run loop: every worker's starting context."""
        return WorkerContext.from_scaling(
            self.scaling,
            world_size=world_size,
            use_fp16=self.use_fp16,
            timeout_s=self.failure.collective_timeout_s,
        )

    def setup_workers(self, group: WorkerGroup) -> None:
        """Run loop: each worker gets the loop, its context and its dataset shards."""
        owner = self.owner
        shards = owner.split_datasets(len(group), [m.node_id for m in group.metadata])
        spec = worker_entry.LoopSpec(
            fn=owner.train_loop_per_worker,
            config=owner.train_loop_config,
            takes_config=owner.takes_config,
            backend=self.backend,
            context=self.context(len(group)),
            board=owner.board_handle,
            run_url=owner.run_url,
            experiment_name=owner.name,
            trial_name=owner.trial_name,
            options=owner.extras.worker_options(owner),
        )
        group.get(
            [
                group.execute_single_async(
                    rank, worker_entry.setup_session, spec, info, device, shards[rank]
                )
                for rank, (info, device) in enumerate(
                    zip(group.rank_infos, group.device_indices, strict=True)
                )
            ]
        )

    def pollers(self) -> list[Callable[[], None]]:
        """Run loop: the report feed's sinks see rank 0's reports while the loop runs."""
        feed = self.owner.feed
        return [feed.poll] if feed is not None and feed.sinks else []

    def restart_source(self) -> str | None:
        """Run loop: a restarted loop starts from the latest committed checkpoint."""
        return self.owner._board_call("latest_checkpoint") or "the start (no checkpoint yet)"

    def before_restart(self, planned: bool) -> None:
        """Run loop: the new group's board attempt announces nothing old."""
        self._announced = None

    def run(self) -> None:
        """Run the loop on every worker; a retried attempt starts from the latest checkpoint.

        A loop that a drain stopped at its checkpoint runs again, in a group off the
        draining node, from that checkpoint.
        """
        while True:
            try:
                results = self.loop.call(worker_entry.run_loop, args_fn=self.owner.attempt_args)
            except BaseException:
                if self._announced is not None:
                    logger.warning(
                        "%s, and the loop reported no checkpoint after it was told; the run "
                        "fails with the error below (not retried, or FailureConfig "
                        "max_failures=%d spent). Its latest checkpoint is %s.",
                        self._announced.describe(),
                        self.owner.run_config.failure_config.max_failures,
                        self.owner._board_call("latest_checkpoint") or "none",
                    )
                raise
            stop = next((r for r in results if isinstance(r, LoopStopped)), None)
            if stop is None:
                if self._announced is not None:
                    logger.warning(
                        "The loop returned while %s: the run is complete, nothing to move.",
                        _lower_first(self._announced.describe()),
                    )
                return
            self._announced = None
            self.loop.leave_drained_nodes(
                DrainCheckpoint(
                    path=self.owner._board_call("latest_checkpoint"),
                    where=f"report {stop.index}",
                    resume=(
                        "A trainer with the same RunConfig(storage_path, name) continues from "
                        "it (get_checkpoint())"
                    ),
                )
            )

    def on_drain(self, event: DrainEvent, new: bool) -> None:
        """Run loop: tell the loop of a new drain of the group's nodes, through the report board."""
        if not new:
            return
        info = PreemptionInfo.from_event(event, self._announced)
        first = self.owner._board_call("announce_preemption", info)
        self._announced = info
        logger.warning(
            "%s: the loop sees it in train.get_preemption_info() from its next report() on "
            "(report %d of the run; %s on the node). Every rank stops at the first "
            "checkpoint it reports then and the group restarts off the node from it; a loop "
            "that reports none is restarted from its latest checkpoint (%s) once the node is "
            "gone, as after a lost worker (FailureConfig max_failures=%d).",
            event.describe(),
            first,
            event.describe_ranks(),
            self.owner._board_call("latest_checkpoint") or "none yet",
            self.owner.run_config.failure_config.max_failures,
        )

    def shutdown(self) -> None:
        """Stop the workers; the run is over."""
        self.loop.close()


class _TFLoopRunner(_LoopRunner):
    """The worker group of a TensorFlow loop (a backend of the tensorflow framework)."""

    framework = "tensorflow"


class DataParallelTrainer:
    """Run your own training function on every worker (Ray Train's ``DataParallelTrainer``).

    Args:
        train_loop_per_worker: ``fn()`` or ``fn(config)``, run on every worker.
        train_loop_config: the dict passed to the function.
        backend: a backend name (``ddp``, ``horovod``, ``fairscale``, ``fsdp``,
            ``deepspeed``) or a :class:`~polytrain.backends.Backend`.
        backend_config: the backend's typed config, or a dict of its fields.
        scaling_config: :class:`~polytrain.launchers.scaling.ScalingConfig` or a dict.
        run_config: :class:`~polytrain.train.config.RunConfig` (storage, name, failures,
            checkpoint retention).
        datasets: ``{name: ray.data.Dataset}``; each worker reads its split with
            ``get_dataset_shard(name)``.
        resume_from_checkpoint: a :class:`Checkpoint` that ``get_checkpoint()`` returns
            until the run commits its own.
        use_fp16: the backend's mixed precision (``autocast()`` and ``backward()``).
        dataset_config: :class:`~polytrain.train.DataConfig`: which ``datasets`` are split.
        metadata: Ray Train 1.x's; refused.
        validation_config: :class:`~polytrain.train.ValidationConfig`: validate reported
            checkpoints while training goes on.
    """

    _default_backend = "ddp"
    _runner_cls: type[_LoopRunner] = _LoopRunner

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        backend: str | Backend | None = None,
        backend_config: Any = None,
        scaling_config: ScalingConfig | dict | None = None,
        run_config: RunConfig | dict | None = None,
        datasets: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        use_fp16: bool = False,
        dataset_config: Any = None,
        metadata: Any = None,
        validation_config: Any = None,
    ) -> None:
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise ConfigTypeError(
                f"train_loop_config must be a dict or None; got "
                f"{type(train_loop_config).__name__}: {train_loop_config!r}."
            )
        self.takes_config = check_loop(train_loop_per_worker, train_loop_config)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config or {})
        self.backend = backend if backend is not None else self._default_backend
        backend_config, user_backend = RunExtras.split_backend_config(backend_config)
        self.extras = RunExtras(validation_config, dataset_config, metadata, user_backend)
        self.backend_config = backend_config
        self.scaling_config = coerce_scaling(scaling_config)
        self.run_config = coerce(RunConfig, run_config, "run_config")
        self.datasets = _check_datasets(datasets)
        self.extras.check_datasets(self.datasets)
        if resume_from_checkpoint is not None and not isinstance(
            resume_from_checkpoint, Checkpoint
        ):
            raise ConfigTypeError(
                f"resume_from_checkpoint must be a polytrain.train.Checkpoint; got "
                f"{type(resume_from_checkpoint).__name__}: {resume_from_checkpoint!r}."
            )
        self.resume_from_checkpoint = resume_from_checkpoint
        self.use_fp16 = bool(use_fp16)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        self.name = self.run_config.name or f"{type(self).__name__}_{stamp}"
        self.run_url = Storage(self.run_config.storage_location()).child(self.name).url
        self.board: ReportBoard | None = None
        self.board_handle: Any = None
        self.feed: ReportFeed | None = None
        self.trial_name: str | None = None  # set inside a Tune trial
        self._report_sinks: list[Sink] = []
        self._runner: _LoopRunner | None = None

    restore = classmethod(refuse_restore)
    can_restore = classmethod(refuse_restore)

    @property
    def num_restarts(self) -> int:
        """Restarts of the worker group after lost or hung workers in the last ``fit()``.

        Counted in ``FailureConfig.max_failures``; 0 before the first ``fit()``.
        """
        return self._runner.loop.num_restarts if self._runner is not None else 0

    @property
    def num_drains(self) -> int:
        """Drained nodes the last ``fit()`` moved its workers off (see ``get_preemption_info``).

        Counted in ``FailureConfig.max_preemption_failures`` (Ray calls a drain a
        preemption), not in :attr:`num_restarts`; 0 before the first ``fit()``.
        """
        return self._runner.loop.num_drains if self._runner is not None else 0

    @property
    def num_preemptions(self) -> int:
        """Deprecated name of :attr:`num_drains`."""
        renamed("num_preemptions", "num_drains", DRAIN_WORD)
        return self.num_drains

    def add_report_sink(self, sink: Sink) -> None:
        """Driver: call ``sink(entry)`` with each of rank 0's reports while ``fit()`` runs.

        ``entry`` is the reported metrics plus ``_index`` (the report's number from 0),
        ``_timestamp`` and ``_checkpoint`` (the committed checkpoint's URL, or None).
        Sinks run in the driver process, in report order, within about 0.25 s of the
        last rank's report; an exception in a sink ends the run.
        """
        self._report_sinks.append(sink)

    def as_trainable(self) -> Any:
        """A Ray Tune trainable that runs this trainer's loop once per trial.

        Prefer :class:`polytrain.tune.Tuner` (``Tuner(trainer, param_space=...)``), which
        calls this. See :mod:`polytrain.train.tuning` for trial configs and resources.
        """
        from polytrain.train.tuning import make_loop_trainable

        return make_loop_trainable(self)

    def for_trial(
        self, loop_config: dict[str, Any], scaling: ScalingConfig | dict | None
    ) -> DataParallelTrainer:
        """A copy for one Tune trial: ``loop_config`` merged into ``train_loop_config``.

        Args:
            loop_config: the trial's ``train_loop_config`` entries (they win).
            scaling: a :class:`ScalingConfig` that replaces the trainer's, or a dict of
                fields that update it, or None.
        """
        trial = copy.copy(self)
        trial.train_loop_config = {**self.train_loop_config, **loop_config}
        trial.takes_config = check_loop(self.train_loop_per_worker, trial.train_loop_config)
        if isinstance(scaling, dict):
            scaling = dataclasses.replace(self.scaling_config, **scaling)
        trial.scaling_config = coerce_scaling(scaling or self.scaling_config)
        trial._report_sinks = list(self._report_sinks)
        return trial

    # --------------------------------------------------------------- driver
    def split_datasets(
        self, num_workers: int, node_ids: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """One ``{name: DataIterator}`` per worker (a fresh split for every group)."""
        return self.extras.split_datasets(self.datasets, num_workers, node_ids)

    def attempt_args(self) -> tuple[int, str | None]:
        """The arguments of one attempt: the first step index and the checkpoint to start from."""
        size = self._runner.num_workers  # the restarted group's size (elastic: maybe fewer)
        start = self._board_call("new_attempt", max(size, 1))
        latest = self._board_call("latest_checkpoint")
        if latest is None and self.resume_from_checkpoint is not None:
            latest = self.resume_from_checkpoint.path
        return start, latest

    def _board_call(self, method: str, *args: Any) -> Any:
        if self.board is not None:
            return getattr(self.board, method)(*args)
        import ray

        return ray.get(getattr(self.board_handle, method).remote(*args))

    def _make_board(self) -> None:
        config = self.run_config.checkpoint_config
        Storage(self.run_url).makedirs()
        if self.scaling_config.local_mode:
            self.board = self.board_handle = ReportBoard(self.run_url, config)
            return
        from polytrain.launchers.cluster.connect import ensure_ray

        ensure_ray(self.scaling_config.address)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the driver's node: a local storage_path is where the driver reads the result.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        actor = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=here)(ReportBoard)
        self.board_handle = actor.remote(self.run_url, config)

    def fit(self) -> Result:
        """Run the loop on every worker until it returns; a lost worker restarts it.

        Returns:
            :class:`Result`: rank 0's last metrics, the latest committed checkpoint, the
            run's path and every report as ``metrics_dataframe``.

        Raises:
            WorkerGroupError: the loop raised on a worker, or workers died more often than
                ``FailureConfig.max_failures`` allows; also a
                :class:`~polytrain.errors.WorkerError` (rank and traceback attached) and,
                where Python allows, an instance of the worker's exception class.
            ControllerError: the driver side failed (placement, storage, a callback).
            PreemptionError: more drained nodes than ``max_preemption_failures``.
        """
        if self.scaling_config.local_mode and torchrun_world() is not None:
            return fit_under_torchrun(self)  # one rank of torchrun's world, no Ray
        self._make_board()
        trackers = self._make_feed()
        self._runner: _LoopRunner | None = None
        try:
            self._runner = self._runner_cls(self)
            self._runner.run()
            self.feed.poll()  # the reports after the last poll
            self.extras.finish()  # validations still running
            return self._result()
        except BaseException as error:
            with contextlib.suppress(Exception):
                self.feed.poll()  # the reports made before the failure still count
            failed = self.extras.failed(error)  # Ray Train's error kinds
            if failed is error:
                raise
            raise failed from error
        finally:
            if trackers is not None:
                trackers.finish()
            if self._runner is not None:
                self._runner.shutdown()
            if self.board is None and self.board_handle is not None:
                import ray

                ray.kill(self.board_handle)

    def _make_feed(self) -> TrackerSink | None:
        """The feed of this fit's reports; its tracker sink (None without ``loggers``)."""
        sinks = list(self._report_sinks) + self.extras.sinks(self)
        trackers = None
        if self.run_config.loggers is not None:
            storage = Storage(self.run_url)
            from polytrain.loggers import default_log_dir

            log_dir = storage.path() if storage.local else str(default_log_dir())
            run_info = {
                "config": dict(self.train_loop_config),
                "backend": getattr(self.backend, "name", self.backend),
                "num_workers": self.scaling_config.num_workers,
                "framework": self._runner_cls.framework,
                "name": self.name,
            }
            trackers = TrackerSink(self.run_config.loggers, log_dir, run_info)
            sinks.append(trackers)
        self.feed = ReportFeed(lambda count: self._board_call("entries_since", count), sinks)
        if self.board is not None:  # local mode: the board calls back after each report
            self.board.listener = self.feed.poll
        return trackers

    def _result(self) -> Result:
        return self.extras.result(self, self._board_call("snapshot"))


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _check_datasets(datasets: Any) -> dict[str, Any]:
    if datasets is None:
        return {}
    if not isinstance(datasets, dict):
        raise ConfigTypeError(
            f"datasets must be a dict of names to ray.data.Dataset; got "
            f"{type(datasets).__name__}: {datasets!r}."
        )
    for name, dataset in datasets.items():
        if not hasattr(dataset, "streaming_split"):
            raise ConfigTypeError(
                f"datasets[{name!r}] must be a ray.data.Dataset (e.g. ray.data.from_items(...)); "
                f"got {type(dataset).__name__}."
            )
    return dict(datasets)


__all__ = ["DataParallelTrainer", "check_loop"]
