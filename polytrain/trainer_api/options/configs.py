"""Typed option groups of a trainer: scaling, failure handling, checkpoints.

The trainers accept these dataclasses, plain dicts of their fields, or (for the
common options) flat keyword arguments such as ``num_workers=2``.
:class:`ScalingConfig` lives in :mod:`polytrain.launchers.scaling` (the worker
groups are built from it) and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, TypeVar

from polytrain.compat.deprecation import DRAIN_WORD, renamed
from polytrain.compat.omegaconf_values import plain_config
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import (
    PLACEMENT_STRATEGIES,
    ScalingConfig,
    check_int,
    check_number,
)

SCHEDULER_STEP_FREQS = ("batch", "epoch", "manual")

__all__ = [
    "PLACEMENT_STRATEGIES",
    "SCHEDULER_STEP_FREQS",
    "CheckpointConfig",
    "FailureConfig",
    "ScalingConfig",
    "check_user_config",
    "coerce_config",
    "merge_flat_options",
]

T = TypeVar("T")


@dataclass
class FailureConfig:
    """What to do when a worker fails or hangs.

    Attributes:
        max_retries: restarts of the worker group after a lost or hung worker, over the
            trainer's life, before the error is raised; 0 raises at the first failure.
            3 by default (RaySGD's default): a restart resumes from the state of the
            last epoch end, which every epoch end captures while this is above 0
            (see docs/failures.md for what that costs). An exception raised by
            user code is never retried. ``train(max_retries=n)`` sets a budget of
            ``n`` restarts for one call instead.
        hang_timeout_s: if no worker makes progress for this long, collect every
            worker's stack and treat it as a failure; None disables the watchdog.
        collective_timeout_s: timeout of one collective operation (the process group
            timeout of the torch backends, Horovod's gloo timeout). TensorFlow's
            ``mwms`` backend has its own, off by default:
            ``backend_config={"collective_timeout_s": ...}`` (see ``MWMSConfig``).
        max_checkpoint_failures: checkpoint writes that may fail in a row (disk full,
            permission lost, a store that errors) before ``train()`` raises
            :class:`~polytrain.errors.CheckpointError`; until then training continues with a
            warning and a ``checkpoint_error`` metric, and the previous checkpoint stays
            the one to resume from. 1 stops at the first failed write.
        max_drains: drains (Ray's announced loss of a node of the group: the group stops
            at a step, checkpoints there and moves off the node, see docs/failures.md)
            the trainer survives, counted apart from ``max_retries``; one more shuts it
            down with :class:`~polytrain.errors.DrainLimitError` after the checkpoint.
            None (the default): unlimited, like Ray Train's ``max_preemption_failures``.
        max_preemptions: the former name of ``max_drains`` (deprecated; it sets ``max_drains``).
    """

    max_retries: int = 3
    hang_timeout_s: float | None = None
    collective_timeout_s: float = 1800.0
    max_checkpoint_failures: int = 3
    max_drains: int | None = None
    max_preemptions: int | None = None

    def __post_init__(self) -> None:
        check_int("max_retries", self.max_retries, 0)
        if self.max_preemptions is not None:
            check_int("max_preemptions", self.max_preemptions, 0)
            if self.max_drains is not None and self.max_drains != self.max_preemptions:
                raise ConfigError(
                    f"failure_config sets max_drains={self.max_drains} and its former name "
                    f"max_preemptions={self.max_preemptions}: set max_drains only."
                )
            renamed("failure_config max_preemptions", "max_drains", DRAIN_WORD)
            # Moved over, not mirrored: a dataclasses.replace() copy does not warn again.
            self.max_drains, self.max_preemptions = self.max_preemptions, None
        if self.max_drains is not None:
            check_int("max_drains", self.max_drains, 0)
        check_number("hang_timeout_s", self.hang_timeout_s, 0, allow_none=True)
        check_number("collective_timeout_s", self.collective_timeout_s, 1)
        check_int("max_checkpoint_failures", self.max_checkpoint_failures, 1)


@dataclass
class CheckpointConfig:
    """Where and how checkpoints are written.

    Attributes:
        checkpoint_dir: the workers write a checkpoint directory here at every epoch
            end (``checkpoint_000003/``; each rank its own part, sharded backends their
            shards): a local path, NFS, or an fsspec URL such as ``s3://bucket/run``.
            None: with recovery on, a temporary directory of the trainer's own on the
            driver's node (workers on other nodes then send the state through the
            driver; give shared storage for multi-node runs).
        num_to_keep: how many committed checkpoints to keep in ``checkpoint_dir``.
        async_save: write checkpoints in the background: training continues after the
            workers copied their part to host memory; the directory's ``COMMITTED``
            marker appears when every rank has written.
        resume: at start, load the newest committed checkpoint in ``checkpoint_dir``
            (if there is one) and continue from it: a crashed driver's run resumes by
            running the same script (or ``polytrain train --resume``) again.
        every_n_steps: also checkpoint every this many batches inside an epoch
            (``checkpoint_000003.00000040/``: 40 batches into the 4th epoch), with the
            data position: a restart continues at the next batch, so a lost worker
            costs at most this many steps instead of the epoch. None: epoch ends only.
        every_s: also checkpoint inside an epoch once this many seconds have passed
            since the last checkpoint (checked every few batches, see docs/checkpoints.md).
    """

    checkpoint_dir: str | None = None
    num_to_keep: int = 2
    async_save: bool = False
    resume: bool = False
    every_n_steps: int | None = None
    every_s: float | None = None

    def __post_init__(self) -> None:
        check_int("num_to_keep", self.num_to_keep, 1)
        if self.every_n_steps is not None:
            check_int("every_n_steps", self.every_n_steps, 1)
        check_number("every_s", self.every_s, 0.001, allow_none=True)
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise ConfigTypeError(
                    f"checkpoint_dir must be a path or URL string; got "
                    f"{type(self.checkpoint_dir).__name__}: {self.checkpoint_dir!r}."
                )
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
        for name in ("async_save", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"{name} must be True or False; got {getattr(self, name)!r}.")
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError(
                "resume=True continues from the newest checkpoint in checkpoint_dir, but "
                "checkpoint_dir is None. Set checkpoint_dir (the same one as the run to resume)."
            )


def coerce_config(cls: type[T], value: Any, name: str) -> T:
    """Build option group ``cls`` from an instance, a dict of its fields or None.

    An OmegaConf ``DictConfig`` counts as a dict (its interpolations resolved).

    Raises:
        ConfigTypeError: an unknown key, or a value that is none of the three.
        ConfigError: a field value the option group rejects, or a ``DictConfig``
            with a missing (``???``) or unresolvable value.
    """
    value = plain_config(value, name)
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        _check_keys(cls, value, name)
        return cls(**value)
    raise ConfigTypeError(
        f"{name} must be a {cls.__name__}, a dict or None; got {type(value).__name__}: {value!r}."
    )


def _check_keys(cls: type, value: dict[str, Any], name: str) -> None:
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigTypeError(f"Unknown {name} key(s) {unknown}. Allowed keys: {allowed}.")


def _explicit_keys(cls: type, value: Any) -> set[str]:
    """The fields ``value`` (a dict or an instance of ``cls``) sets itself.

    A dict sets the keys it contains. An instance cannot tell a field passed with
    its default value from one left out, so it counts as setting the fields
    whose value differs from the default.
    """
    if value is None:
        return set()
    if isinstance(value, dict):
        return set(value)
    explicit = set()
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            explicit.add(field.name)  # no default: always given
            continue
        if getattr(value, field.name) != default:
            explicit.add(field.name)
    return explicit


def merge_flat_options(cls: type[T], value: Any, name: str, **flat: Any) -> T:
    """``coerce_config`` plus flat keyword shortcuts (``num_workers=2``).

    A shortcut whose value is None is not given. A given shortcut fills in its
    field of the option group, unless the group sets that field too: then the
    option is given twice and this raises, even when both values agree. A dict
    group sets the keys it contains; an instance sets the fields that differ from
    their defaults (an instance cannot tell an explicit default from an omitted
    field). So ``num_workers=4, scaling_config={"address": "auto"}`` is fine, and
    ``num_workers=4, scaling_config={"num_workers": 2}`` is an error.

    Raises:
        ConfigError: an option given both ways.
        ConfigTypeError: ``value`` of the wrong type, or an unknown key.
    """
    value = plain_config(value, name)
    given = {k: v for k, v in flat.items() if v is not None}
    if isinstance(value, dict):
        _check_keys(cls, value, name)
    elif value is not None and not isinstance(value, cls):
        coerce_config(cls, value, name)  # raises the type error
    twice = sorted(set(given) & _explicit_keys(cls, value))
    if twice:
        raise ConfigError(
            f"{twice} given both as keyword argument(s) and inside {name}; "
            f"set each option in one place."
        )
    if isinstance(value, dict):
        # One construction with everything: fields are validated together
        # (e.g. min_workers against a num_workers given as a shortcut).
        return cls(**{**value, **given})
    config = coerce_config(cls, value, name)
    return dataclasses.replace(config, **given) if given else config


def check_user_config(config: Any) -> dict[str, Any]:
    """A copy of the user's hyperparameters, with ``batch_size`` (the global batch) checked.

    An OmegaConf ``DictConfig`` (a Hydra app's ``cfg`` or a section of it) becomes a
    plain dict with its interpolations resolved; ``ListConfig`` values inside it
    become lists.

    Raises:
        ConfigTypeError: ``config`` is not a dict (or None).
        ConfigError: ``batch_size`` is not a positive int; a ``DictConfig`` with a
            missing (``???``) or unresolvable value (the message names its key).
    """
    config = plain_config(config, "config")
    if config is not None and not isinstance(config, dict):
        raise ConfigTypeError(
            f"config must be a dict (or an OmegaConf DictConfig); got "
            f"{type(config).__name__}: {config!r}."
        )
    config = dict(config or {})
    batch = config.get("batch_size")
    if "batch_size" in config and (
        isinstance(batch, bool) or not isinstance(batch, int) or batch < 1
    ):
        raise ConfigError(
            f"config['batch_size'] must be a positive int (the global batch); got {batch!r}."
        )
    return config
