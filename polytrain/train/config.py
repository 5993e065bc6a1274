"""Ray Train's option groups for the function API: ``ScalingConfig``, ``RunConfig``, ``FailureConfig``, ``CheckpointConfig``, ``LoggingConfig``, ``DataConfig``.

:class:`ScalingConfig` is polytrain's own
(:class:`polytrain.launchers.scaling.ScalingConfig`) plus Ray Train 2.x's fields. The
others carry Ray Train's field names and defaults; :meth:`FailureConfig.to_polytrain`
maps onto the creator API's option group so both APIs share one failure policy.
Options Ray Train 2.x removed raise
:class:`~polytrain.train.errors.DeprecatedOptionError` (a ``DeprecationWarning``, as
Ray raises), naming what to use instead; options polytrain cannot honour raise
:class:`~polytrain.errors.ConfigError` with the reason.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers import scaling as launcher_scaling
from polytrain.launchers.scaling import check_int, check_number
from polytrain.train.errors import DeprecatedOptionError
from polytrain.trainer_api.options import configs as polytrain_configs

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FailureConfig",
    "LoggingConfig",
    "RunConfig",
    "ScalingConfig",
    "SyncConfig",
    "coerce",
    "coerce_scaling",
]

#: Ray Train's link for its 2.x removals.
RAY_V2_ISSUE = "https://github.com/ray-project/ray/issues/49454"


@dataclass
class ScalingConfig(launcher_scaling.ScalingConfig):
    """How many workers, with which resources: polytrain's fields plus Ray Train 2.x's.

    Beyond :class:`polytrain.launchers.scaling.ScalingConfig`'s fields (``num_workers``,
    ``use_gpu``, ``resources_per_worker``, ``placement_strategy``, ``min_workers``,
    ``num_gpus_per_worker``, ...):

    Attributes:
        num_workers: an int, or Ray Train's elastic ``(min_workers, max_workers)``
            tuple (polytrain's ``min_workers`` and ``num_workers``).
        trainer_resources: removed in Ray Train 2.x; refused.
        accelerator_type: place workers on nodes with this accelerator (Ray's
            ``accelerator_type:<name>`` resource, a sliver per worker, as Ray Train does).
        label_selector, use_tpu, topology: Ray Train's label and TPU placement; refused
            (polytrain places by resources; use ``resources_per_worker`` with a custom
            resource).
        elastic_resize_monitor_interval_s: Ray Train's growth check; polytrain grows an
            elastic group back at restarts, so only the default (60) is accepted.
    """

    trainer_resources: dict | None = None
    accelerator_type: str | None = None
    label_selector: Any = None
    use_tpu: bool = False
    topology: str | None = None
    elastic_resize_monitor_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.trainer_resources is not None:
            raise DeprecatedOptionError(
                f"ScalingConfig(trainer_resources={self.trainer_resources!r}) is removed (as in "
                f"Ray Train 2.x): the driver side reserves no resources. See {RAY_V2_ISSUE}."
            )
        if isinstance(self.num_workers, tuple):
            if len(self.num_workers) != 2 or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in self.num_workers
            ):
                raise ConfigTypeError(
                    f"ScalingConfig(num_workers={self.num_workers!r}) must be an int or a tuple "
                    f"of two ints (min_workers, max_workers)."
                )
            if self.min_workers is not None:
                raise ConfigError(
                    f"ScalingConfig(num_workers={self.num_workers!r}, min_workers="
                    f"{self.min_workers!r}): give the minimum once."
                )
            self.min_workers, self.num_workers = self.num_workers
        refused = {
            "label_selector": (self.label_selector, None),
            "use_tpu": (self.use_tpu, False),
            "topology": (self.topology, None),
        }
        for name, (value, default) in refused.items():
            if value != default:
                raise ConfigError(
                    f"ScalingConfig({name}={value!r}) is not supported: polytrain places workers by "
                    f"resources (no labels, no TPU slices). Give the nodes a custom resource and "
                    f"ask for it with resources_per_worker={{'my_resource': 1}}."
                )
        if self.elastic_resize_monitor_interval_s != 60.0:
            raise ConfigError(
                f"ScalingConfig(elastic_resize_monitor_interval_s="
                f"{self.elastic_resize_monitor_interval_s!r}) is not supported: an elastic "
                f"polytrain group grows back when it restarts, not on a timer. Leave the default."
            )
        if self.accelerator_type is not None:
            if not isinstance(self.accelerator_type, str):
                raise ConfigTypeError(
                    f"ScalingConfig(accelerator_type=...) must be a Ray accelerator type name "
                    f"(e.g. 'H100'); got {self.accelerator_type!r}."
                )
            key = f"accelerator_type:{self.accelerator_type}"
            self.resources_per_worker = {**(self.resources_per_worker or {}), key: 0.001}
        super().__post_init__()

    @property
    def max_workers(self) -> int:
        """The largest group (``num_workers``)."""
        return self.num_workers

    @property
    def elasticity_enabled(self) -> bool:
        """Whether the group may shrink after a failure (``min_workers`` set)."""
        return self.min_workers is not None

    @property
    def num_cpus_per_worker_resolved(self) -> float:
        """CPUs per worker."""
        return float(self.num_cpus_per_worker)

    @property
    def total_resources(self) -> dict[str, float]:
        """Every resource the workers reserve together (at ``num_workers``)."""
        total: dict[str, float] = {}
        for key, value in self.worker_bundle().items():
            total[key] = total.get(key, 0.0) + value * max(self.num_workers, 1)
        return total

    @property
    def additional_resources_per_worker(self) -> dict[str, float]:
        """The custom resources of a worker (all but CPU and GPU)."""
        return dict(self.resources_per_worker or {})


#: Where runs go when ``RunConfig.storage_path`` is not set (Ray Train: ``~/ray_results``).
DEFAULT_STORAGE_PATH = "~/polytrain_results"
_NAME = re.compile(r"^[A-Za-z0-9_.=+-][A-Za-z0-9_.=+ -]*$")


@dataclass
class FailureConfig:
    """What to do when a worker dies or hangs (Ray Train's ``FailureConfig``).

    Attributes:
        max_failures: restarts of the worker group after a worker failed: an exception
            raised by the loop, a lost (killed, out of memory, node gone) or hung worker
            (Ray Train's rule); each restart runs the loop again from the start, and
            ``get_checkpoint()`` returns the latest committed checkpoint. -1: no limit
            (Ray Train's meaning). 0 (the default, as in Ray Train): none.
        hang_timeout_s: polytrain's hang watchdog: no report and no progress for this
            long counts as a failure. None: off.
        collective_timeout_s: timeout of one collective (process group / Horovod).
        max_preemption_failures: drains (Ray's announced loss of a node; Ray Train calls
            it a preemption) the run moves off, counted apart from ``max_failures``: the
            loop reports a checkpoint once ``get_preemption_info()`` answers, and the group
            restarts off the node from it (docs/own-loop.md). One more drain ends ``fit()``
            with :class:`~polytrain.errors.DrainLimitError` after that checkpoint. -1 (the
            default, as in Ray Train): no limit. The creator API's
            ``FailureConfig.max_drains``.
    """

    max_failures: int = 0
    hang_timeout_s: float | None = None
    collective_timeout_s: float = 1800.0
    max_preemption_failures: int = -1
    fail_fast: Any = None
    controller_failure_limit: int = -1
    relax_collectives_on_preemption: bool = False
    preemption_grace_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fail_fast is not None:
            raise DeprecatedOptionError(
                f"FailureConfig(fail_fast={self.fail_fast!r}) is removed (as in Ray Train 2.x): "
                f"a worker's error ends the run unless max_failures retries it. See {RAY_V2_ISSUE}."
            )
        if self.controller_failure_limit != -1:
            raise ConfigError(
                f"FailureConfig(controller_failure_limit={self.controller_failure_limit!r}) is not "
                f"supported: the driver is your own process, not a restartable actor; a driver "
                f"error ends fit() with a ControllerError. Leave the default (-1)."
            )
        if self.relax_collectives_on_preemption or self.preemption_grace_s:
            raise ConfigError(
                f"FailureConfig(relax_collectives_on_preemption={self.relax_collectives_on_preemption!r}"
                f", preemption_grace_s={self.preemption_grace_s!r}) is not supported: polytrain "
                f"stops every rank at the checkpoint the loop reports after a drain and moves the "
                f"group off the node before its deadline (docs/own-loop.md). Leave the defaults."
            )
        check_int("max_failures", self.max_failures, -1)
        check_number("hang_timeout_s", self.hang_timeout_s, 0, allow_none=True)
        check_number("collective_timeout_s", self.collective_timeout_s, 1)
        value = self.max_preemption_failures
        wrong_type = isinstance(value, bool) or not isinstance(value, int)
        if wrong_type or value < -1:
            raise (ConfigTypeError if wrong_type else ConfigError)(
                f"FailureConfig(max_preemption_failures={value!r}) must be an int: -1 (no "
                f"limit, the default), 0 (the first drained node ends fit() after its "
                f"checkpoint) or the number of drained nodes to move off."
            )

    def to_polytrain(self) -> polytrain_configs.FailureConfig:
        """The creator API's :class:`~polytrain.trainer_api.options.configs.FailureConfig`."""
        retries = 2**31 - 1 if self.max_failures < 0 else self.max_failures
        drains = None if self.max_preemption_failures < 0 else self.max_preemption_failures
        return polytrain_configs.FailureConfig(
            max_retries=retries,
            hang_timeout_s=self.hang_timeout_s,
            collective_timeout_s=self.collective_timeout_s,
            max_drains=drains,
        )


@dataclass
class CheckpointConfig:
    """Which reported checkpoints are kept (Ray Train's ``CheckpointConfig``).

    Attributes:
        num_to_keep: keep this many committed checkpoints (the best by
            ``checkpoint_score_attribute``, else the newest); the latest one is always
            kept as well, for restarts, and one whose validation is pending. None: keep all.
        checkpoint_score_attribute: a key of the metrics reported with a checkpoint to
            rank them by (``"a/b"`` reaches a nested ``{"a": {"b": ...}}``); None: by
            order (newest best). A NaN score ranks below every other (dropped first), a
            missing one below every number (Ray Train's rule).
        checkpoint_score_order: "max" or "min".
        checkpoint_frequency, checkpoint_at_end: removed in Ray Train 2.x; refused.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    checkpoint_frequency: Any = None
    checkpoint_at_end: Any = None

    def __post_init__(self) -> None:
        for name in ("checkpoint_frequency", "checkpoint_at_end"):
            if getattr(self, name) is not None:
                raise DeprecatedOptionError(
                    f"CheckpointConfig({name}={getattr(self, name)!r}) is removed (as in Ray Train "
                    f"2.x): it does not apply to your own loop, which reports checkpoints when "
                    f"it chooses. Remove it."
                )
        if self.num_to_keep is not None:
            check_int("num_to_keep", self.num_to_keep, 1)
        if self.checkpoint_score_order not in ("max", "min"):
            raise ConfigError(
                f"checkpoint_score_order must be 'max' or 'min'; got "
                f"{self.checkpoint_score_order!r}."
            )
        attribute = self.checkpoint_score_attribute
        if attribute is not None and not isinstance(attribute, str):
            raise ConfigTypeError(
                f"checkpoint_score_attribute must be a metric name (str) or None; got "
                f"{type(attribute).__name__}: {attribute!r}."
            )


@dataclass
class LoggingConfig:
    """The level of polytrain's own logs on the driver and in the workers (Ray Train's ``LoggingConfig``).

    Attributes:
        log_level: a ``logging`` level name (``"DEBUG"``, ``"INFO"``, ...); applied to the
            ``polytrain`` logger for the run.
    """

    log_level: str = "INFO"

    def __post_init__(self) -> None:
        levels = logging.getLevelNamesMapping()
        if not isinstance(self.log_level, str) or self.log_level.upper() not in levels:
            raise ConfigError(
                f"Invalid log_level: {self.log_level!r}. Must be one of: "
                f"{', '.join(repr(x) for x in sorted(levels))}."
            )
        self.log_level = self.log_level.upper()


class DataConfig:
    """How ``datasets=`` reach the workers (Ray Train's ``DataConfig``).

    Args:
        datasets_to_split: ``"all"`` (the default) or the names of the datasets each
            worker gets a split of (``streaming_split(num_workers, equal=True)``); every
            worker reads the whole of the others.
        execution_options: Ray Data's ``ExecutionOptions`` for the splits (one for all,
            or a dict per dataset name); None: Ray Data's defaults.
        enable_shard_locality: prefer splits on the worker's node (Ray Data's
            ``locality_hints``).

    Raises:
        ConfigTypeError: ``datasets_to_split`` neither ``"all"`` nor a list of names.
    """

    def __init__(
        self,
        datasets_to_split: str | list[str] = "all",
        execution_options: Any = None,
        enable_shard_locality: bool = True,
    ) -> None:
        if not (datasets_to_split == "all" or isinstance(datasets_to_split, list)):
            raise ConfigTypeError(
                f"`datasets_to_split` should be a 'all' or a list of strings of dataset names. "
                f"Received {type(datasets_to_split).__name__} with value {datasets_to_split!r}."
            )
        self.datasets_to_split = datasets_to_split
        self.execution_options = execution_options
        self.enable_shard_locality = bool(enable_shard_locality)

    def splits(self, name: str) -> bool:
        """Whether dataset ``name`` is split among the workers."""
        return self.datasets_to_split == "all" or name in self.datasets_to_split

    def options_for(self, name: str) -> Any:
        """The execution options of dataset ``name``, or None."""
        if isinstance(self.execution_options, dict):
            return self.execution_options.get(name)
        return self.execution_options


class SyncConfig:
    """Ray Train 1.x's syncing of trial directories; removed in 2.x, refused here.

    Raises:
        DeprecatedOptionError: always; storage is ``RunConfig(storage_path=...)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DeprecatedOptionError(
            "SyncConfig is removed (as in Ray Train 2.x): checkpoints are written straight to "
            "RunConfig(storage_path=...) (a shared path or a URL such as s3://bucket/runs). "
            f"See {RAY_V2_ISSUE}."
        )


#: RunConfig fields Ray Train 2.x refuses (Ray Tune's options).
_RUN_DEPRECATED = ("sync_config", "verbose", "stop", "progress_reporter", "log_to_file")


@dataclass
class RunConfig:
    """Where a run writes and how it handles failures (Ray Train's ``RunConfig``).

    Attributes:
        name: the run's folder below ``storage_path``; None: the trainer's class name
            and the start time. A second trainer with the same ``storage_path`` and
            ``name`` continues the run: ``get_checkpoint()`` returns its latest
            committed checkpoint.
        storage_path: a local directory (NFS for several nodes) or an fsspec URL
            (``s3://bucket/runs``, ``gs://...``); None: ``~/polytrain_results``.
        storage_filesystem: a ``pyarrow.fs.FileSystem`` that ``storage_path`` is
            relative to (Ray Train's form; see :class:`~polytrain.train.Checkpoint`).
            ``Result.path`` and the result's checkpoints are then relative to it too.
        failure_config: :class:`FailureConfig` (or a dict of its fields).
        checkpoint_config: :class:`CheckpointConfig` (or a dict of its fields).
        callbacks: :class:`~polytrain.train.UserCallback` instances, called on the driver
            after each report and after a failure. Ray Tune callbacks are refused (they
            go to the Tuner's ``ray.tune.RunConfig``).
        worker_runtime_env: Ray's runtime environment of the workers; only
            ``{"env_vars": {...}}`` is taken (set in every worker before the loop).
        logging_config: :class:`LoggingConfig`.
        loggers: experiment trackers fed from rank 0's ``report()`` calls, as the
            creator API's ``loggers=``: names (``"tensorboard"``, ``"mlflow"``,
            ``"wandb"``, ``"csv"``, or ``"tensorboard,csv"``) and/or
            :class:`polytrain.loggers.Logger` instances. Named ones write into the
            run's directory when it is local (``metrics.csv`` next to the
            checkpoints), else into ``polytrain_runs/run-<time>``.
        sync_config, verbose, stop, progress_reporter, log_to_file: Ray Tune's,
            removed from Ray Train 2.x; refused.
    """

    name: str | None = None
    storage_path: str | os.PathLike | None = None
    failure_config: FailureConfig | dict | None = None
    checkpoint_config: CheckpointConfig | dict | None = None
    verbose: Any = None
    callbacks: list[Any] = field(default_factory=list)
    loggers: Any = None
    storage_filesystem: Any = None
    worker_runtime_env: dict | None = None
    logging_config: LoggingConfig | dict | None = None
    sync_config: Any = None
    stop: Any = None
    progress_reporter: Any = None
    log_to_file: Any = None

    def __post_init__(self) -> None:
        for name in _RUN_DEPRECATED:
            if getattr(self, name) is not None:
                raise DeprecatedOptionError(
                    f"RunConfig({name}=...) is removed (as in Ray Train 2.x): it was a Ray Tune "
                    f"option. Run the trainer as one Tune trial (polytrain.tune.Tuner) if you rely "
                    f"on it. See {RAY_V2_ISSUE}."
                )
        self.failure_config = coerce(FailureConfig, self.failure_config, "failure_config")
        self.checkpoint_config = coerce(
            CheckpointConfig, self.checkpoint_config, "checkpoint_config"
        )
        self.logging_config = coerce(LoggingConfig, self.logging_config, "logging_config")
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.match(self.name)):
            raise ConfigError(
                f"RunConfig(name=...) must be a folder name (letters, digits, '_.=+- '); got "
                f"{self.name!r}."
            )
        if self.storage_path is not None:
            if not isinstance(self.storage_path, (str, os.PathLike)):
                raise ConfigTypeError(
                    f"storage_path must be a path or fsspec URL string; got "
                    f"{type(self.storage_path).__name__}: {self.storage_path!r}."
                )
            self.storage_path = os.fspath(self.storage_path)
        if self.storage_filesystem is not None:
            from polytrain.train.checkpoint import pyarrow_location

            if self.storage_path is None:
                raise ConfigError(
                    "RunConfig(storage_filesystem=...) needs storage_path: the path on that "
                    "filesystem (without a scheme, e.g. 'bucket/runs')."
                )
            pyarrow_location(self.storage_filesystem, self.storage_path)  # refused now if unusable
        self.callbacks = _check_callbacks(self.callbacks)
        self.worker_runtime_env = _check_worker_env(self.worker_runtime_env)
        if self.loggers is not None:
            from polytrain.loggers import resolve_loggers

            # Names and types checked now, not at the end of a run; nothing is written yet.
            resolve_loggers(self.loggers, log_dir=".")

    def storage_location(self) -> str:
        """Where runs go: ``storage_path`` as a polytrain location (a ``storage_filesystem`` resolved)."""
        if self.storage_filesystem is not None:
            from polytrain.train.checkpoint import pyarrow_location

            return pyarrow_location(self.storage_filesystem, os.fspath(self.storage_path))
        return self.storage_path or DEFAULT_STORAGE_PATH


def _check_callbacks(callbacks: Any) -> list[Any]:
    from polytrain.train.callbacks import UserCallback

    callbacks = list(callbacks or [])
    others = [cb for cb in callbacks if not isinstance(cb, UserCallback)]
    if others:
        raise ConfigError(
            f"RunConfig(callbacks={others!r}): callbacks must be polytrain.train.UserCallback "
            f"instances (as in Ray Train 2.x). For trackers use RunConfig(loggers=['csv', "
            f"'tensorboard', ...]) (names or polytrain.loggers.Logger instances); for Tune "
            f"callbacks pass ray.tune.RunConfig(callbacks=...) to polytrain.tune.Tuner."
        )
    return callbacks


def _check_worker_env(value: Any) -> dict[str, dict[str, str]] | None:
    if value is None:
        return None
    env = dict(value) if isinstance(value, dict) else getattr(value, "to_dict", lambda: None)()
    if not isinstance(env, dict) or set(env) - {"env_vars"}:
        raise ConfigError(
            f"RunConfig(worker_runtime_env={value!r}): polytrain's workers take only "
            f"{{'env_vars': {{...}}}} here; install packages on the nodes, or pass a runtime_env "
            f"to ray.init() for the whole job."
        )
    variables = env.get("env_vars") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items()):
        raise ConfigTypeError(
            f"worker_runtime_env['env_vars'] must map names to strings; got {variables!r}."
        )
    return {"env_vars": dict(variables)}


def coerce_scaling(value: Any) -> ScalingConfig:
    """A :class:`ScalingConfig` from one, from polytrain's base class (the creator API's), a dict or None."""
    import dataclasses

    if isinstance(value, launcher_scaling.ScalingConfig) and not isinstance(value, ScalingConfig):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return ScalingConfig(**fields)
    return polytrain_configs.coerce_config(ScalingConfig, value, "scaling_config")


def coerce(cls: type, value: Any, name: str) -> Any:
    """``cls`` from an instance, a dict of its fields or None (Ray Train's own class is refused)."""
    return polytrain_configs.coerce_config(cls, value, name)
