"""Driver logic shared by every trainer: the worker group's life, calls into it, shutdown."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from polytrain.backends.base import Backend, WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.errors import TrainerShutdownError, WorkerError
from polytrain.launchers.local import LocalWorkerGroup
from polytrain.trainer_api.config import CheckpointConfig, FailureConfig, ScalingConfig

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


def _shutdown_group(backend: Backend, group: Any) -> None:
    try:
        backend.on_shutdown(group)
    except Exception:  # noqa: BLE001 - shutdown must go on with dead workers
        logger.debug("backend.on_shutdown failed", exc_info=True)
    group.shutdown()


class BaseTrainer:
    """Shared driver logic: start the group, run worker functions, tear down on failure.

    Subclasses set ``framework`` and implement :meth:`_setup_workers`.
    """

    framework: ClassVar[str] = "torch"

    def __init__(
        self,
        backend: str | Backend,
        backend_config: Any,
        scaling: ScalingConfig,
        failure: FailureConfig,
        checkpoint: CheckpointConfig,
        use_fp16: bool = False,
        use_tqdm: bool = False,
    ) -> None:
        self._group: Any = None
        self._shut_down = False
        self.backend = get_backend(backend, backend_config, framework=self.framework)
        self.scaling = scaling
        self.failure = failure
        self.checkpoint = checkpoint
        self.use_fp16 = bool(use_fp16)
        self.use_tqdm = bool(use_tqdm)
        self.backend.validate_settings(
            num_workers=scaling.num_workers, use_gpu=scaling.use_gpu, use_fp16=self.use_fp16
        )
        self.epoch = 0

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
            world_size=self.scaling.world_size,
            use_gpu=self.scaling.use_gpu,
            use_fp16=self.use_fp16,
            num_cpus=int(self.scaling.num_cpus_per_worker) or 1,
            local_mode=self.scaling.local_mode,
            timeout_s=self.failure.collective_timeout_s,
        )

    def _make_group(self) -> Any:
        env = self.backend.worker_env_vars()
        if self.scaling.local_mode:
            return LocalWorkerGroup(env_vars=env)
        from polytrain.launchers.worker_group import WorkerGroup, ensure_ray

        ensure_ray(self.scaling.address)
        return WorkerGroup(
            num_workers=self.scaling.num_workers,
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

    def _setup_workers(self, group: Any) -> None:
        raise NotImplementedError  # pragma: no cover - every trainer overrides it

    def _ensure_open(self) -> None:
        if self._shut_down:
            raise TrainerShutdownError(
                f"This {type(self).__name__} is shut down; create a new one."
            )

    def _run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        progress: str | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker and return the results in rank order.

        A worker failure tears the whole group down before the error reaches the
        caller, so no worker is left blocked in a collective.
        """
        self._ensure_open()
        group = self._group
        bar = _ProgressBar(group, progress) if progress and self.use_tqdm and len(group) else None
        try:
            if self.scaling.local_mode:
                results = group.execute(fn, *args)
            else:
                refs = group.execute_async(fn, *args)
                results = group.get(refs, on_poll=bar.poll if bar else None, poll_interval_s=0.25)
        except WorkerError:
            if bar:
                bar.close()
            self._abort()
            raise
        except BaseException:
            if bar:
                bar.close()
            if not self.scaling.local_mode:
                self._abort()  # e.g. KeyboardInterrupt: stop the workers now
            raise
        if bar:
            bar.close(results[0] if isinstance(results[0], dict) else None)
        return results

    def _abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            _shutdown_group(self.backend, group)
            if getattr(self, "_finalizer", None) is not None:
                self._finalizer.detach()
        self._shut_down = True

    def shutdown(self) -> None:
        """Stop every worker and release their resources. Later calls raise."""
        if self._group is not None:
            self._finalizer.detach()
            _shutdown_group(self.backend, self._group)
            self._group = None
        self._shut_down = True

    def __enter__(self) -> BaseTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
