"""Ray Train's option groups for the function API: ``RunConfig``, ``FailureConfig``, ``CheckpointConfig``.

``ScalingConfig`` is polytrain's own (:class:`polytrain.launchers.scaling.ScalingConfig`):
it already takes Ray Train's field names (``num_workers``, ``use_gpu``,
``resources_per_worker``, ``placement_strategy``). The others carry Ray Train's
field names and defaults; :meth:`FailureConfig.to_polytrain` maps onto the
creator API's option group so both APIs share one failure policy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import ScalingConfig, check_int, check_number
from polytrain.trainer_api.options import configs as polytrain_configs

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig", "coerce"]

#: Where runs go when ``RunConfig.storage_path`` is not set (Ray Train: ``~/ray_results``).
DEFAULT_STORAGE_PATH = "~/polytrain_results"
_NAME = re.compile(r"^[A-Za-z0-9_.=+-][A-Za-z0-9_.=+ -]*$")


@dataclass
class FailureConfig:
    """What to do when a worker dies or hangs (Ray Train's ``FailureConfig``).

    Attributes:
        max_failures: restarts of the worker group after a lost (killed, out of memory,
            node gone) or hung worker; each restart runs the loop again from the start,
            and ``get_checkpoint()`` returns the latest committed checkpoint. -1: no
            limit (Ray Train's meaning). 0 (the default, as in Ray Train): none. An
            exception raised by the loop itself is never retried.
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

    def __post_init__(self) -> None:
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
            kept as well, for restarts. None: keep all.
        checkpoint_score_attribute: a key of the metrics reported with a checkpoint to
            rank them by; None: by order (newest best).
        checkpoint_score_order: "max" or "min".
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"

    def __post_init__(self) -> None:
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
class RunConfig:
    """Where a run writes and how it handles failures (Ray Train's ``RunConfig``).

    Attributes:
        name: the run's folder below ``storage_path``; None: the trainer's class name
            and the start time. A second trainer with the same ``storage_path`` and
            ``name`` continues the run: ``get_checkpoint()`` returns its latest
            committed checkpoint.
        storage_path: a local directory (NFS for several nodes) or an fsspec URL
            (``s3://bucket/runs``, ``gs://...``); None: ``~/polytrain_results``.
        failure_config: :class:`FailureConfig` (or a dict of its fields).
        checkpoint_config: :class:`CheckpointConfig` (or a dict of its fields).
        verbose: unused; accepted for Ray Train compatibility.
        callbacks: Ray Train's Tune callbacks; refused here: trackers go in ``loggers``,
            Tune callbacks in the Tuner's own ``ray.tune.RunConfig(callbacks=...)``.
        loggers: experiment trackers fed from rank 0's ``report()`` calls, as the
            creator API's ``loggers=``: names (``"tensorboard"``, ``"mlflow"``,
            ``"wandb"``, ``"csv"``, or ``"tensorboard,csv"``) and/or
            :class:`polytrain.loggers.Logger` instances. Named ones write into the
            run's directory when it is local (``metrics.csv`` next to the
            checkpoints), else into ``polytrain_runs/run-<time>``.
    """

    name: str | None = None
    storage_path: str | os.PathLike | None = None
    failure_config: FailureConfig | dict | None = None
    checkpoint_config: CheckpointConfig | dict | None = None
    verbose: Any = None
    callbacks: list[Any] = field(default_factory=list)
    loggers: Any = None

    def __post_init__(self) -> None:
        self.failure_config = coerce(FailureConfig, self.failure_config, "failure_config")
        self.checkpoint_config = coerce(
            CheckpointConfig, self.checkpoint_config, "checkpoint_config"
        )
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
        if self.callbacks:
            raise ConfigError(
                f"RunConfig(callbacks={self.callbacks!r}) is not supported by polytrain's "
                f"function API. For trackers use RunConfig(loggers=['csv', 'tensorboard', ...]) "
                f"(names or polytrain.loggers.Logger instances); for Tune callbacks pass "
                f"ray.tune.RunConfig(callbacks=...) to polytrain.tune.Tuner."
            )
        if self.loggers is not None:
            from polytrain.loggers import resolve_loggers

            # Names and types checked now, not at the end of a run; nothing is written yet.
            resolve_loggers(self.loggers, log_dir=".")


def coerce(cls: type, value: Any, name: str) -> Any:
    """``cls`` from an instance, a dict of its fields or None (Ray Train's own class is refused)."""
    return polytrain_configs.coerce_config(cls, value, name)
