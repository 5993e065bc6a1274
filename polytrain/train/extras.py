"""The driver side of Ray Train's options that the core run loop does not know.

A function-API trainer keeps one :class:`RunExtras`: it resolves Ray Train's
``backend_config`` forms (a ``TorchConfig``, a custom
:class:`~polytrain.train.backend.BackendConfig`), splits ``datasets`` as the
:class:`~polytrain.train.DataConfig` says, gives the workers their Ray Train options
(validation, working directory, log level, environment), adds the report sinks of
``RunConfig(callbacks=...)`` and ``validation_config``, waits for the validations
before ``fit()`` returns, and turns a failure into Ray Train's error kinds
(:func:`~polytrain.train.errors.as_training_failed`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError, WorkerError
from polytrain.runs.policies.failure import FailurePolicy
from polytrain.train.backend import BackendConfig, with_user_backend
from polytrain.train.callbacks import CallbackSink, TrainRunContext
from polytrain.train.config import DataConfig, LoggingConfig
from polytrain.train.errors import DeprecatedOptionError, as_training_failed
from polytrain.train.result import Result, from_snapshot
from polytrain.train.validation import ValidationConfig, ValidationRunner

__all__ = ["RunExtras"]

logger = logging.getLogger(__name__)


class RunExtras:
    """Ray Train's options of one trainer (driver side).

    Args:
        validation_config: a :class:`~polytrain.train.ValidationConfig`, or None.
        dataset_config: a :class:`~polytrain.train.DataConfig`, or None (split all).
        metadata: Ray Train 1.x's checkpoint metadata; refused (removed in 2.x).
        user_backend: a custom :class:`~polytrain.train.BackendConfig` (its hooks), or None.

    Raises:
        DeprecatedOptionError: ``metadata`` given.
        ConfigTypeError: a wrong type for the others.
    """

    def __init__(
        self,
        validation_config: ValidationConfig | None = None,
        dataset_config: DataConfig | None = None,
        metadata: Any = None,
        user_backend: BackendConfig | None = None,
    ) -> None:
        if metadata is not None:
            raise DeprecatedOptionError(
                "DataParallelTrainer(metadata=...) is removed (as in Ray Train 2.x): pass what the "
                "loop needs in train_loop_config, and store metadata with "
                "Checkpoint.set_metadata()."
            )
        if validation_config is not None and not isinstance(validation_config, ValidationConfig):
            raise ConfigTypeError(
                f"validation_config must be a polytrain.train.ValidationConfig; got "
                f"{type(validation_config).__name__}: {validation_config!r}."
            )
        if dataset_config is not None and not isinstance(dataset_config, DataConfig):
            raise ConfigTypeError(
                f"dataset_config must be a polytrain.train.DataConfig; got "
                f"{type(dataset_config).__name__}: {dataset_config!r}."
            )
        self.validation_config = validation_config
        self.dataset_config = dataset_config or DataConfig()
        self.user_backend = user_backend
        self._callbacks: CallbackSink | None = None
        self._validations: ValidationRunner | None = None

    # ------------------------------------------------------------ construction
    @staticmethod
    def split_backend_config(backend_config: Any) -> tuple[Any, BackendConfig | None]:
        """``(polytrain backend config, custom BackendConfig)`` of a trainer's ``backend_config``."""
        if isinstance(backend_config, BackendConfig):
            to_polytrain = getattr(backend_config, "to_polytrain", None)
            if to_polytrain is not None:  # TorchConfig & co: Ray's names for a backend's options
                return to_polytrain(), None
            return None, backend_config
        return backend_config, None

    def check_datasets(self, datasets: dict[str, Any]) -> None:
        """Refuse a ``DataConfig`` that names datasets the trainer did not get.

        Raises:
            ConfigError: an unknown name in ``datasets_to_split``.
        """
        names = self.dataset_config.datasets_to_split
        if names != "all":
            unknown = sorted(set(names) - set(datasets))
            if unknown:
                raise ConfigError(
                    f"DataConfig(datasets_to_split={names!r}) names {unknown}, which are not in "
                    f"datasets={sorted(datasets)}."
                )

    def backend(self, backend: Any) -> Any:
        """The polytrain backend instance with the custom hooks around it (or ``backend`` unchanged)."""
        if self.user_backend is None:
            return backend
        return with_user_backend(backend, self.user_backend)

    # ------------------------------------------------------------ per fit()
    def worker_options(self, trainer: Any) -> dict[str, Any]:
        """What every worker's session needs of Ray Train's options (plain, picklable data)."""
        run_config = trainer.run_config
        options: dict[str, Any] = {"has_validation": self.validation_config is not None}
        if run_config.logging_config != LoggingConfig():
            options["log_level"] = run_config.logging_config.log_level
        if run_config.worker_runtime_env:
            options["env_vars"] = dict(run_config.worker_runtime_env["env_vars"])
        from polytrain.train.constants import _get_ray_train_session_dir, chdir_to_trial_dir

        if chdir_to_trial_dir() and not trainer.scaling_config.local_mode:
            options["working_dir"] = Path(_get_ray_train_session_dir(), trainer.name).as_posix()
        if self.user_backend is not None:
            options["train_func_context"] = self.user_backend.train_func_context
        return options

    def split_datasets(
        self, datasets: dict[str, Any], num_workers: int, node_ids: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """One ``{name: DataIterator}`` per worker: split as the ``DataConfig`` says.

        Args:
            datasets: the trainer's ``datasets``.
            num_workers: the group's size.
            node_ids: each worker's node (for ``enable_shard_locality``), or None.
        """
        shards: list[dict[str, Any]] = [{} for _ in range(num_workers)]
        config = self.dataset_config
        for name, dataset in datasets.items():
            options = config.options_for(name)
            if options is not None:
                dataset.context.execution_options = options
            if not config.splits(name):
                for rank in range(num_workers):
                    shards[rank][name] = dataset.iterator()
                continue
            hints = list(node_ids) if config.enable_shard_locality and node_ids else None
            splits = dataset.streaming_split(num_workers, equal=True, locality_hints=hints)
            for rank, iterator in enumerate(splits):
                shards[rank][name] = iterator
        return shards

    def sinks(self, trainer: Any) -> list[Any]:
        """The report sinks of this ``fit()``: the user's callbacks, then the validations."""
        run_config = trainer.run_config
        sinks: list[Any] = []
        self._callbacks = None
        if run_config.callbacks:
            context = TrainRunContext(
                run_config=run_config,
                train_loop_config=trainer.train_loop_config,
                scaling_config=trainer.scaling_config,
                backend_config=self.user_backend or trainer.backend_config,
                dataset_config=self.dataset_config,
            )
            self._callbacks = CallbackSink(run_config.callbacks, context)
            sinks.append(self._callbacks)
        self._validations = None
        if self.validation_config is not None:
            self._validations = ValidationRunner(
                self.validation_config,
                lambda index, metrics, status: trainer._board_call(
                    "validation_done", index, metrics, status
                ),
                local=trainer.scaling_config.local_mode,
            )
            sinks.append(self._validations)
        return sinks

    def failure_policy(self, max_retries: int) -> FailurePolicy:
        """The function API's failure policy: Ray Train's (an exception in the loop is retried too)."""
        return LoopFailurePolicy(max_retries, self)

    def worker_failed(self, error: BaseException) -> None:
        """A worker failed and the group restarts: the callbacks' ``after_exception``."""
        if self._callbacks is not None and isinstance(error, WorkerError):
            self._callbacks.failed({error.rank: error})

    def finish(self) -> None:
        """The loop is done: wait for every validation (their results update the kept checkpoints)."""
        if self._validations is not None:
            self._validations.finish()

    def failed(self, error: BaseException) -> BaseException:
        """The run failed with ``error``: tell the callbacks, stop validations; the error ``fit()`` raises."""
        if self._validations is not None:
            self._validations.abort()
        if self._callbacks is not None and isinstance(error, WorkerError):
            self._callbacks.failed({error.rank: error})
        return as_training_failed(error)

    def result(self, trainer: Any, snapshot: dict[str, Any]) -> Result:
        """The :class:`Result` of the run's board snapshot."""
        run_config = trainer.run_config
        filesystem = run_config.storage_filesystem
        run_path = None
        if filesystem is not None:
            run_path = f"{str(run_config.storage_path).rstrip('/')}/{trainer.name}"
        return from_snapshot(snapshot, trainer.run_url, run_path, filesystem)


def apply_timeout(trainer: Any, timeout_s: float, source: str) -> None:
    """Set the run's collective timeout from a Ray backend config (``TorchConfig.timeout_s``).

    Raises:
        ConfigError: ``FailureConfig.collective_timeout_s`` was set to another value.
    """
    failure = trainer.run_config.failure_config
    if failure.collective_timeout_s not in (1800.0, timeout_s):
        raise ConfigError(
            f"{source}(timeout_s={timeout_s!r}) and FailureConfig(collective_timeout_s="
            f"{failure.collective_timeout_s!r}) disagree: set the timeout in one place."
        )
    failure.collective_timeout_s = float(timeout_s)


def refuse_restore(cls: type, *args: Any, **kwargs: Any) -> Any:
    """Ray Train 1.x's ``Trainer.restore`` / ``can_restore``, removed in 2.x: refused.

    Raises:
        DeprecatedOptionError: always; a trainer with the same ``RunConfig(storage_path,
            name)`` continues the run.
    """
    raise DeprecatedOptionError(
        f"{cls.__name__}.restore / can_restore are removed (as in Ray Train 2.x): create the "
        f"trainer again with the same RunConfig(storage_path=..., name=...); its loop's "
        f"get_checkpoint() returns the run's latest checkpoint."
    )


class LoopFailurePolicy(FailurePolicy):
    """Ray Train's rule for ``FailureConfig.max_failures``: every worker failure is retried.

    An exception raised by the loop counts like a lost or hung worker (Ray Train 2.x
    restarts the group from the latest checkpoint for any worker error); each retried
    failure reaches every UserCallback's ``after_exception``.

    Args:
        max_retries: restarts allowed over the run (``max_failures``).
        extras: the trainer's :class:`RunExtras` (its callbacks).
    """

    retryable = (WorkerError,)

    def __init__(self, max_retries: int, extras: RunExtras) -> None:
        super().__init__(max_retries, option="FailureConfig max_failures")
        self.extras = extras

    def record_restart(self, error: BaseException, *args: Any, **kwargs: Any) -> None:
        """Count the restart, log it, tell the callbacks."""
        super().record_restart(error, *args, **kwargs)
        self.extras.worker_failed(error)
