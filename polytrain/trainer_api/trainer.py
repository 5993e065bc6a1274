"""Driver logic shared by every trainer: the worker group's life, calls into it, shutdown."""

from __future__ import annotations

import abc
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from polytrain.backends.base import Backend, WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.errors import ConfigError, TrainerShutdownError, WorkerDiedError, WorkerHangError
from polytrain.launchers.local import LocalWorkerGroup
from polytrain.trainer_api import checkpoint as ckpt
from polytrain.trainer_api.config import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
    merge_flat_options,
)

logger = logging.getLogger(__name__)


class _ProgressBar:
    """A tqdm bar on the driver that follows rank 0's progress through the monitor channel."""

    def __init__(self, group: Any, description: str) -> None:
        from tqdm.auto import tqdm

        self._group = group
        self._bar = tqdm(desc=description, unit="batch", leave=True, dynamic_ncols=True)
        self._pending = None

    def poll(self) -> None:
        import ray

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return
            try:
                progress = ray.get(self._pending)
            except Exception:  # noqa: BLE001 - a dead worker is reported by the main wait
                progress = None
            self._pending = None
            if progress and progress.get("phase") == "train":
                self.update(progress)
        self._pending = self._group.monitor_single_async(0, "progress")

    def update(self, progress: dict[str, Any]) -> None:
        if progress.get("total") is not None and self._bar.total != progress["total"]:
            self._bar.total = progress["total"]
        self._bar.n = progress.get("step", 0)
        if progress.get("loss") is not None:
            self._bar.set_postfix(loss=f"{progress['loss']:.4f}", refresh=False)
        self._bar.refresh()

    def close(self, final: dict[str, Any] | None = None) -> None:
        if final:
            steps = final.get("num_steps")
            if steps is not None:
                self._bar.total = self._bar.total or steps
                self._bar.n = steps
            if "loss" in final:
                self._bar.set_postfix(loss=f"{final['loss']:.4f}", refresh=False)
        self._bar.close()


class _HangWatchdog:
    """Raises :class:`WorkerHangError` when no worker reports progress for ``timeout_s``.

    Progress is read through the workers' monitor channel, which answers from its
    own thread while the training thread is blocked, so even a worker stuck in a
    collective can say where it is stuck.
    """

    def __init__(self, group: Any, timeout_s: float) -> None:
        self._group = group
        self._timeout_s = timeout_s
        self._pending: list[Any] | None = None
        self._last: list[Any] = [None] * len(group)
        self._last_change = time.monotonic()

    def poll(self) -> None:
        import ray

        if self._pending is not None:
            ready, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            if len(ready) == len(self._pending):
                records = []
                for ref in self._pending:
                    try:
                        records.append(ray.get(ref))
                    except Exception:  # noqa: BLE001 - a dead worker is reported by the main wait
                        records.append(None)
                keys = [_progress_key(r) for r in records]
                if keys != self._last:
                    self._last = keys
                    self._last_change = time.monotonic()
                self._pending = None
        if time.monotonic() - self._last_change > self._timeout_s:
            raise self._hang_error()
        if self._pending is None:
            self._pending = [
                self._group.monitor_single_async(rank, "progress")
                for rank in range(len(self._group))
            ]

    def _hang_error(self) -> WorkerHangError:
        stacks = self._group.monitor("stacks", timeout_s=10.0)
        progress = self._group.monitor("progress", timeout_s=5.0)
        steps = [p.get("step", -1) if isinstance(p, dict) else -1 for p in progress]
        frames = [_innermost_frame(s) if isinstance(s, str) else "" for s in stacks]
        # The stuck rank: furthest behind, and among equals one whose training thread
        # sits in user code rather than waiting inside a library (a collective).
        slowest = min(range(len(steps)), key=lambda r: (steps[r], _is_library_frame(frames[r]), r))
        lines = [
            f"No worker made progress for {self._timeout_s:g}s (hang_timeout_s); the group is "
            f"torn down. Stuck: rank {slowest} (step {steps[slowest]}, at {frames[slowest]}). "
            f"Per rank:"
        ]
        dump = []
        for rank, (record, stack) in enumerate(zip(progress, stacks, strict=True)):
            where = _innermost_frame(stack) if isinstance(stack, str) else f"no answer ({stack!r})"
            state = record if isinstance(record, dict) else {}
            lines.append(
                f"  rank {rank}: phase {state.get('phase')}, epoch {state.get('epoch')}, step "
                f"{state.get('step')}, stuck at {where}"
            )
            dump.append(f"--- rank {rank} ---\n{stack}")
        return WorkerHangError("\n".join(lines), rank=slowest, remote_traceback="\n".join(dump))


def _progress_key(record: Any) -> Any:
    if not isinstance(record, dict):
        return None
    return (record.get("phase"), record.get("epoch"), record.get("step"))


def _is_library_frame(frame: str) -> bool:
    return "site-packages" in frame or "/polytrain/" in frame or not frame


def _innermost_frame(stack: str) -> str:
    """The last ``File ..., line ..., in ...`` line of the first (training) thread's stack."""
    first_thread = stack.split("\n\n")[0]
    frames = [
        line.strip() for line in first_thread.splitlines() if line.strip().startswith("File ")
    ]
    return frames[-1] if frames else "(no Python frame)"


def _shutdown_group(backend: Backend, group: Any) -> None:
    try:
        backend.on_shutdown(group)
    except Exception:  # noqa: BLE001 - shutdown must go on with dead workers
        logger.debug("backend.on_shutdown failed", exc_info=True)
    group.shutdown()


class BaseTrainer(abc.ABC):
    """Shared driver logic: start the group, run worker functions, tear down on failure.

    Subclasses set ``framework`` and implement :meth:`_setup_workers`.
    """

    framework: ClassVar[str] = "torch"

    def __init__(
        self,
        *,
        backend: str | Backend,
        backend_config: Any,
        config: dict[str, Any] | None,
        scaling_config: ScalingConfig | dict | None,
        failure_config: FailureConfig | dict | None,
        checkpoint_config: CheckpointConfig | dict | None,
        scaling_shortcuts: dict[str, Any],
        use_fp16: bool = False,
        use_tqdm: bool = False,
    ) -> None:
        """Validate the options every trainer shares; subclasses then call :meth:`_start`.

        ``scaling_shortcuts`` are the flat keyword arguments (``num_workers=2``) that
        override fields of ``scaling_config``; giving one both ways is an error.
        """
        self._group: Any = None  # first: shutdown() and the finalizer work if validation fails
        self._shut_down = False
        self.scaling = merge_flat_options(
            ScalingConfig, scaling_config, "scaling_config", **scaling_shortcuts
        )
        self.failure = merge_flat_options(FailureConfig, failure_config, "failure_config")
        self.checkpoint = merge_flat_options(
            CheckpointConfig, checkpoint_config, "checkpoint_config"
        )
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"config must be a dict; got {type(config).__name__}: {config!r}.")
        self.config = dict(config or {})
        batch = self.config.get("batch_size")
        if "batch_size" in self.config and (
            isinstance(batch, bool) or not isinstance(batch, int) or batch < 1
        ):
            raise ConfigError(
                f"config['batch_size'] must be a positive int (the global batch); got {batch!r}."
            )
        self.use_fp16 = bool(use_fp16)
        self.use_tqdm = bool(use_tqdm)
        self.backend = get_backend(backend, backend_config, framework=self.framework)
        self.backend.validate_settings(
            num_workers=self.scaling.num_workers,
            use_gpu=self.scaling.use_gpu,
            use_fp16=self.use_fp16,
        )
        self.epoch = 0
        self.num_restarts = 0
        self._group_size = self.scaling.num_workers
        self._latest_state: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, path: str | Any, **overrides: Any) -> BaseTrainer:
        """Build a trainer from a YAML run config (see :mod:`polytrain.trainer_api.run_config`).

        ``overrides`` use dotted keys for nested values, e.g. ``{"config.lr": 0.1}``.
        """
        from polytrain.trainer_api.run_config import trainer_from_config

        return trainer_from_config(path, trainer_cls=cls, **overrides)

    @classmethod
    def as_trainable(cls, **trainer_kwargs: Any) -> Any:
        """A Ray Tune trainable that builds this trainer for every trial (see :mod:`polytrain.tune`)."""
        from polytrain.tune import make_trainable

        return make_trainable(cls, **trainer_kwargs)

    # ------------------------------------------------------------- lifecycle
    @property
    def backend_name(self) -> str:
        """The canonical name of the backend in use."""
        return self.backend.name

    def _context_template(self) -> WorkerContext:
        return WorkerContext(
            world_size=max(self._group_size, 1),
            use_gpu=self.scaling.use_gpu,
            use_fp16=self.use_fp16,
            num_cpus=int(self.scaling.num_cpus_per_worker) or 1,
            local_mode=self.scaling.local_mode,
            timeout_s=self.failure.collective_timeout_s,
        )

    @property
    def num_workers(self) -> int:
        """Workers in the running group (fewer than requested while shrunk by elastic training)."""
        return self._group_size

    def _make_group(self) -> Any:
        env = self.backend.worker_env_vars()
        if self.scaling.local_mode:
            return LocalWorkerGroup(env_vars=env)
        from polytrain.launchers.worker_group import WorkerGroup, ensure_ray

        ensure_ray(self.scaling.address)
        return WorkerGroup(
            num_workers=self._group_size,
            num_cpus_per_worker=self.scaling.num_cpus_per_worker,
            num_gpus_per_worker=1 if self.scaling.use_gpu else 0,
            resources_per_worker=self.scaling.resources_per_worker,
            placement_strategy=self.scaling.placement_strategy,
            start_timeout_s=self.scaling.start_timeout_s,
            env_vars=env,
        )

    def _start(self) -> None:
        group = self._make_group()
        group.start()
        try:
            self.backend.on_start(group, self._context_template())
            self._setup_workers(group)
        except BaseException:
            _shutdown_group(self.backend, group)
            raise
        self._group = group
        # Release the actors even if the user never calls shutdown().
        self._finalizer = weakref.finalize(self, _shutdown_group, self.backend, group)

    @abc.abstractmethod
    def _setup_workers(self, group: Any) -> None:
        """Driver: build the framework's components in every worker of a new group."""

    def _ensure_open(self) -> None:
        if self._shut_down:
            raise TrainerShutdownError(
                f"This {type(self).__name__} is shut down; create a new one."
            )

    def _run_once(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker once and return the results in rank order.

        A worker failure tears the whole group down before the error reaches the
        caller, so no worker is left blocked in a collective. With
        ``hang_timeout_s`` set, a watchdog turns a group that stopped making
        progress into a :class:`WorkerHangError` carrying every worker's stack.
        """
        self._ensure_open()
        group = self._group
        if self.scaling.local_mode:
            return group.execute(fn, *args)
        bar = _ProgressBar(group, progress) if progress and self.use_tqdm else None
        watchdog = (
            _HangWatchdog(group, self.failure.hang_timeout_s)
            if self.failure.hang_timeout_s is not None
            else None
        )
        pollers = [p.poll for p in (bar, watchdog) if p is not None]

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
        if bar:
            bar.close(results[0] if isinstance(results[0], dict) else None)
        return results

    def _run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker (results in rank order), restarting the group after a lost or hung worker.

        A worker that died (killed, out of memory, node lost) or hung is replaced:
        the group is torn down, a new one starts, the latest epoch-end checkpoint
        is restored and the call is repeated, up to ``max_retries`` restarts over
        the trainer's life. An exception raised by user code is not retried
        (it would fail the same way again) and shuts the trainer down.
        """
        while True:
            try:
                return self._run_once(fn, *args, progress=progress)
            except (WorkerDiedError, WorkerHangError) as exc:
                if self.num_restarts >= self.failure.max_retries:
                    self._shut_down = True
                    raise
                self.num_restarts += 1
                logger.warning(
                    "Restarting the worker group (restart %d of at most %d) after: %s",
                    self.num_restarts,
                    self.failure.max_retries,
                    str(exc).splitlines()[0],
                )
                self._restart()
            except BaseException:
                self._shut_down = True
                raise

    def _restart(self, num_workers: int | None = None) -> None:
        """Start a fresh group and restore the latest epoch-end state into it.

        With ``min_workers`` set, the new group has as many workers as the cluster
        can hold now (at least ``min_workers``; waits up to ``start_timeout_s``).
        """
        self._teardown_group()
        if num_workers is None and self.scaling.min_workers is not None:
            num_workers = self._elastic_size()
        self._group_size = num_workers or self.scaling.num_workers
        self._start()
        if self._latest_state is not None:
            self.load_state_dict(self._latest_state)

    def _placeable_workers(self) -> int:
        """How many more worker bundles the cluster's free resources hold now."""
        import ray

        available = ray.available_resources()
        bundle = {"CPU": float(self.scaling.num_cpus_per_worker)}
        if self.scaling.use_gpu:
            bundle["GPU"] = 1.0
        bundle.update(self.scaling.resources_per_worker or {})
        return int(min(available.get(k, 0.0) // v for k, v in bundle.items() if v > 0))

    def _elastic_size(self) -> int:
        """The group size for a restart: as many as fit, between min_workers and num_workers."""
        from polytrain.errors import InsufficientResourcesError

        minimum = self.scaling.min_workers or self.scaling.num_workers
        time.sleep(1.0)  # freed resources reach the cluster's view (and pending demands) first
        deadline = time.monotonic() + self.scaling.start_timeout_s
        while True:
            fits = min(self._placeable_workers(), self.scaling.num_workers)
            if fits >= minimum:
                if fits < self.scaling.num_workers:
                    logger.warning(
                        "Elastic training: continuing on %d of %d workers (min_workers=%d).",
                        fits,
                        self.scaling.num_workers,
                        minimum,
                    )
                return fits
            if time.monotonic() > deadline:
                raise InsufficientResourcesError(
                    f"After a failure the cluster holds only {fits} worker(s), fewer than "
                    f"min_workers={minimum}, within start_timeout_s="
                    f"{self.scaling.start_timeout_s:g}s. Add resources or lower min_workers."
                )
            time.sleep(0.5)

    def _maybe_grow(self) -> None:
        """At an epoch boundary: back to ``num_workers`` if a shrunk group now fits in full."""
        if self._group_size >= self.scaling.num_workers or self._latest_state is None:
            return
        if self._placeable_workers() + self._group_size < self.scaling.num_workers:
            return
        logger.warning(
            "Elastic training: resources are back; growing from %d to %d workers.",
            self._group_size,
            self.scaling.num_workers,
        )
        self._restart(self.scaling.num_workers)

    def _remember(self, state: dict[str, Any]) -> str | None:
        """Keep an epoch-end state for recovery; also write it to ``checkpoint_dir`` if set."""
        self._latest_state = state
        directory = self.checkpoint.checkpoint_dir
        if directory is None:
            return None
        path = ckpt.save_checkpoint(state, ckpt.epoch_checkpoint_path(directory, state["epoch"]))
        ckpt.prune_checkpoints(directory, self.checkpoint.num_to_keep)
        return str(path)

    @property
    def _keeps_state(self) -> bool:
        return (
            self.failure.max_retries > 0
            or self.checkpoint.checkpoint_dir is not None
            or self.scaling.min_workers is not None
        )

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint dict on every worker (also used to resume after a restart)."""

    def _teardown_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            if getattr(self, "_finalizer", None) is not None:
                self._finalizer.detach()
            _shutdown_group(self.backend, group)

    def shutdown(self) -> None:
        """Stop every worker and release their resources. Later calls raise."""
        self._teardown_group()
        self._shut_down = True

    def __enter__(self) -> BaseTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
