"""Validation of reported checkpoints while training goes on (Ray Train's ``ValidationConfig``).

``trainer = TorchTrainer(loop, validation_config=ValidationConfig(fn=evaluate))`` and
``report(metrics, checkpoint=..., validation=True)`` in the loop: once that checkpoint
is committed, the driver runs ``evaluate(checkpoint, **fn_kwargs)`` as a Ray task (with
``ray_remote_kwargs``: its CPUs, GPUs, retries) while the workers train on. Its
returned metrics are merged into the checkpoint's (so ``CheckpointConfig`` ranks and
keeps checkpoints by a validation metric), and the checkpoint's status becomes
``VALIDATED``, ``VALIDATION_TIMEOUT`` (it ran past ``timeout_s``: the task is
cancelled) or ``VALIDATION_FAILED`` (it raised; logged, training goes on). As in Ray
Train, one validation runs at a time, in report order; a checkpoint is not deleted
while its validation is pending; ``fit()`` returns once every validation has
finished. In local mode (``num_workers=0``) validations run in a thread of the
calling process (a timed-out one is abandoned, not stopped).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.reporting import ReportedCheckpointStatus

__all__ = ["ValidationConfig", "ValidationFn", "ValidationRunner", "ValidationTaskConfig"]

logger = logging.getLogger(__name__)

#: Validations running at once (Ray Train's value).
MAX_IN_FLIGHT = 1


class ValidationFn(Protocol):
    """A function that validates a checkpoint: ``fn(checkpoint, **kwargs) -> dict`` of metrics."""

    def __call__(self, checkpoint: Checkpoint, **kwargs: Any) -> dict:  # noqa: D102
        ...


@dataclass
class ValidationTaskConfig:
    """One validation's options, passed as ``report(..., validation=ValidationTaskConfig(...))``.

    Attributes:
        fn_kwargs: keyword arguments of the validation function (JSON-able); they
            update ``ValidationConfig.task_config.fn_kwargs``.
        timeout_s: seconds the validation may run; None: no limit.
    """

    fn_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.fn_kwargs is None:
            self.fn_kwargs = {}
        if not isinstance(self.fn_kwargs, dict):
            raise ConfigTypeError(
                f"ValidationTaskConfig(fn_kwargs=...) must be a dict of keyword arguments; got "
                f"{type(self.fn_kwargs).__name__}: {self.fn_kwargs!r}."
            )
        timeout = self.timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(
                f"ValidationTaskConfig(timeout_s={timeout!r}) must be None (no limit) or a "
                f"number of seconds > 0."
            )


class ValidationConfig:
    """How the trainer validates reported checkpoints (Ray Train's ``ValidationConfig``).

    Args:
        fn: ``fn(checkpoint, **kwargs) -> dict`` of metrics; it runs in a Ray task on
            the driver's cluster, not in the workers.
        task_config: the defaults of every validation (``fn_kwargs``, ``timeout_s``).
        ray_remote_kwargs: ``ray.remote`` options of the validation task (``num_cpus``,
            ``num_gpus``, ``max_retries``, ...).

    Raises:
        ConfigTypeError: ``fn`` not callable, or a wrong type of the others.
    """

    def __init__(
        self,
        fn: ValidationFn,
        task_config: ValidationTaskConfig | None = None,
        ray_remote_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigTypeError(
                f"ValidationConfig(fn=...) must be a function fn(checkpoint, **kwargs) -> dict; "
                f"got {type(fn).__name__}: {fn!r}."
            )
        if task_config is not None and not isinstance(task_config, ValidationTaskConfig):
            raise ConfigTypeError(
                f"ValidationConfig(task_config=...) must be a ValidationTaskConfig; got "
                f"{type(task_config).__name__}: {task_config!r}."
            )
        if ray_remote_kwargs is not None and not isinstance(ray_remote_kwargs, dict):
            raise ConfigTypeError(
                f"ValidationConfig(ray_remote_kwargs=...) must be a dict of ray.remote options; "
                f"got {type(ray_remote_kwargs).__name__}: {ray_remote_kwargs!r}."
            )
        self.fn = fn
        self.task_config = task_config if task_config is not None else ValidationTaskConfig()
        self.ray_remote_kwargs = dict(ray_remote_kwargs or {})

    def kwargs_for(self, spec: bool | ValidationTaskConfig) -> dict[str, Any]:
        """The validation function's keyword arguments for a report's ``validation=`` value."""
        own = spec.fn_kwargs if isinstance(spec, ValidationTaskConfig) else {}
        return {**self.task_config.fn_kwargs, **own}

    def timeout_for(self, spec: bool | ValidationTaskConfig) -> float | None:
        """The time limit for a report's ``validation=`` value."""
        if isinstance(spec, ValidationTaskConfig):
            return spec.timeout_s
        return self.task_config.timeout_s


def check_request(validation: Any, has_checkpoint: bool, configured: bool) -> Any:
    """Worker: the ``validation=`` argument of ``report``, checked; a picklable spec or False.

    Raises:
        ConfigError: validation without a checkpoint, or without a trainer ``validation_config``.
        ConfigTypeError: neither a bool nor a :class:`ValidationTaskConfig`.
    """
    if not isinstance(validation, (bool, ValidationTaskConfig)):
        raise ConfigTypeError(
            f"report(validation=...) takes True, False or a ValidationTaskConfig; got "
            f"{type(validation).__name__}: {validation!r}."
        )
    if not validation:
        return False
    if not has_checkpoint:
        raise ConfigError("Validation requires a checkpoint to be provided.")
    if not configured:
        raise ConfigError(
            "`validation_config` was not set on the trainer, but a validation was requested: "
            "pass validation_config=ValidationConfig(fn=...) to the trainer, or report without "
            "validation=."
        )
    return validation if isinstance(validation, ValidationTaskConfig) else True


def run_validation(fn: Callable[..., Any], url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The validation task: ``fn(checkpoint, **kwargs)``, whose result must be a dict."""
    metrics = fn(Checkpoint(url), **kwargs)
    if not isinstance(metrics, dict):
        raise ConfigTypeError(
            f"The validation function must return a dictionary of metrics; got "
            f"{type(metrics).__name__}: {metrics!r}."
        )
    return metrics


@dataclass
class _Pending:
    index: int
    url: str
    started: float
    timeout_s: float | None
    handle: Any = None


class ValidationRunner:
    """Driver: runs the validations the reports ask for, one at a time, and posts results to the board.

    It is a report sink (called with each of rank 0's history entries, whose
    ``_validation`` says whether that report asked for one) and is polled with the
    worker group's other pollers.

    Args:
        config: the trainer's :class:`ValidationConfig`.
        post: ``post(index, metrics, status_name)`` records a finished validation (the
            board's ``validation_done``).
        local: run in a thread of this process (local mode) instead of Ray tasks.
    """

    def __init__(
        self, config: ValidationConfig, post: Callable[[int, dict, str], None], local: bool
    ) -> None:
        self.config = config
        self.post = post
        self.local = local
        self.queue: collections.deque[tuple[int, str, Any]] = collections.deque()
        self.running: list[_Pending] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: Any = None

    def __call__(self, entry: dict[str, Any]) -> None:
        spec = entry.get("_validation")
        if spec and entry.get("_checkpoint"):
            self.queue.append((entry["_index"], entry["_checkpoint"], spec_from_board(spec)))
        self.poll()

    # ------------------------------------------------------------------ driver loop
    def poll(self) -> int:
        """Collect finished validations, cancel timed-out ones, start queued ones; the number running."""
        now = time.monotonic()
        for pending in list(self.running):
            if pending.timeout_s is not None and now - pending.started >= pending.timeout_s:
                self.running.remove(pending)
                self._cancel(pending)
                logger.warning(
                    "Validation of checkpoint %s exceeded timeout_s=%s; cancelled.",
                    pending.url,
                    pending.timeout_s,
                )
                self.post(pending.index, {}, ReportedCheckpointStatus.VALIDATION_TIMEOUT.name)
            elif self._done(pending):
                self.running.remove(pending)
                self._finish(pending)
        while self.queue and len(self.running) < MAX_IN_FLIGHT:
            index, url, spec = self.queue.popleft()
            self.running.append(self._start(index, url, spec))
        return len(self.running) + len(self.queue)

    def finish(self, interval_s: float = 0.1) -> None:
        """Wait until every queued and running validation has finished (``fit()`` returns after)."""
        while self.poll():
            time.sleep(interval_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def abort(self) -> None:
        """The run failed: cancel what runs, drop what is queued."""
        for pending in self.running:
            self._cancel(pending)
        self.running.clear()
        self.queue.clear()

    # ------------------------------------------------------------------ one validation
    def _start(self, index: int, url: str, spec: Any) -> _Pending:
        kwargs = self.config.kwargs_for(spec)
        pending = _Pending(index, url, time.monotonic(), self.config.timeout_for(spec))
        if self.local:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "polytrain-validation")
            pending.handle = self._pool.submit(run_validation, self.config.fn, url, kwargs)
        else:
            import ray

            if self._task is None:
                self._task = ray.remote(run_validation)
            options = {"num_cpus": 1, **self.config.ray_remote_kwargs}
            pending.handle = self._task.options(**options).remote(self.config.fn, url, kwargs)
        logger.info("Validating checkpoint %s (report %d).", url, index)
        return pending

    def _done(self, pending: _Pending) -> bool:
        if self.local:
            return pending.handle.done()
        import ray

        ready, _ = ray.wait([pending.handle], timeout=0)
        return bool(ready)

    def _cancel(self, pending: _Pending) -> None:
        if self.local:
            pending.handle.cancel()  # a running thread cannot be stopped: its result is dropped
            return
        import ray

        ray.cancel(pending.handle, force=True)

    def _finish(self, pending: _Pending) -> None:
        try:
            if self.local:
                metrics = pending.handle.result()
            else:
                import ray

                metrics = ray.get(pending.handle)
        except Exception:
            logger.exception("Validation of checkpoint %s failed.", pending.url)
            self.post(pending.index, {}, ReportedCheckpointStatus.VALIDATION_FAILED.name)
            return
        self.post(pending.index, dict(metrics), ReportedCheckpointStatus.VALIDATED.name)


def spec_for_board(spec: Any) -> Any:
    """A report's validation request as the board stores it (plain data, JSON-able)."""
    if isinstance(spec, ValidationTaskConfig):
        return dataclasses.asdict(spec)
    return bool(spec)


def spec_from_board(value: Any) -> bool | ValidationTaskConfig:
    """The inverse of :func:`spec_for_board`."""
    if isinstance(value, dict):
        return ValidationTaskConfig(**value)
    return bool(value)
