"""Typed option groups of a trainer: scaling, failure handling, checkpoints.

The trainers accept these dataclasses, plain dicts of their fields, or (for the
common options) flat keyword arguments such as ``num_workers=2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from polytrain.errors import ConfigError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SCHEDULER_STEP_FREQS = ("batch", "epoch", "manual")

T = TypeVar("T")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name} must be an int >= {minimum}; got {type(value).__name__}: {value!r}."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}.")


def _check_number(name: str, value: Any, minimum: float, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(
            f"{name} must be a number >= {minimum}{' or None' if allow_none else ''}; "
            f"got {value!r}."
        )


@dataclass
class ScalingConfig:
    """How many workers, with which resources, placed how.

    Attributes:
        num_workers: worker actors to start; 0 runs one worker in the driver process
            (local mode, no Ray: for debugging).
        use_gpu: reserve one GPU per worker and train on it (nccl for torch backends).
        num_cpus_per_worker: CPUs reserved per worker; also the worker's torch threads.
        resources_per_worker: extra custom Ray resources per worker.
        placement_strategy: "PACK" (default: as few nodes as possible), "SPREAD",
            "STRICT_PACK" or "STRICT_SPREAD".
        start_timeout_s: fail if the workers cannot be placed within this many seconds.
        address: the Ray cluster to join ("auto", "ray://...", host:port); None uses a
            running instance or starts a local one.
        min_workers: elastic training: after a failure, go on with as many workers as
            the cluster can hold, down to ``min_workers`` (the global batch stays the
            same, so each worker's batch grows), and grow back to ``num_workers`` at an
            epoch boundary once resources return. None: always ``num_workers``.
    """

    num_workers: int = 1
    use_gpu: bool = False
    num_cpus_per_worker: float = 1
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    start_timeout_s: float = 30.0
    address: str | None = None
    min_workers: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_workers", self.num_workers, 0)
        if self.min_workers is not None:
            _check_int("min_workers", self.min_workers, 1)
            if self.min_workers > max(self.num_workers, 1) or self.num_workers == 0:
                raise ConfigError(
                    f"min_workers={self.min_workers} must be between 1 and num_workers="
                    f"{self.num_workers} (and num_workers >= 1: local mode is not elastic)."
                )
        if not isinstance(self.use_gpu, bool):
            raise ConfigError(f"use_gpu must be True or False; got {self.use_gpu!r}.")
        _check_number("num_cpus_per_worker", self.num_cpus_per_worker, 0)
        _check_number("start_timeout_s", self.start_timeout_s, 0)
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"placement_strategy={self.placement_strategy!r} is not supported. Must be one "
                f"of {PLACEMENT_STRATEGIES}."
            )

    @property
    def local_mode(self) -> bool:
        """True for ``num_workers=0``: one worker in the driver process, no Ray."""
        return self.num_workers == 0

    @property
    def world_size(self) -> int:
        """Number of training processes (1 in local mode)."""
        return max(self.num_workers, 1)


@dataclass
class FailureConfig:
    """What to do when a worker fails or hangs.

    Attributes:
        max_retries: restarts of the worker group (from the latest checkpoint) before
            the error is raised; 0 raises at the first failure.
        hang_timeout_s: if no worker makes progress for this long, collect every
            worker's stack and treat it as a failure; None disables the watchdog.
        collective_timeout_s: timeout of one collective operation (the process group
            timeout of the torch backends, Horovod's gloo timeout). TensorFlow's
            ``mwms`` backend has its own, off by default:
            ``backend_config={"collective_timeout_s": ...}`` (see ``MWMSConfig``).
    """

    max_retries: int = 0
    hang_timeout_s: float | None = None
    collective_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        _check_int("max_retries", self.max_retries, 0)
        _check_number("hang_timeout_s", self.hang_timeout_s, 0, allow_none=True)
        _check_number("collective_timeout_s", self.collective_timeout_s, 1)


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written.

    Attributes:
        checkpoint_dir: write a checkpoint here at every epoch end (atomically); None
            keeps the latest one only in the driver's memory.
        num_to_keep: how many epoch checkpoints to keep in ``checkpoint_dir``.
    """

    checkpoint_dir: str | None = None
    num_to_keep: int = 2

    def __post_init__(self) -> None:
        _check_int("num_to_keep", self.num_to_keep, 1)


def coerce_config(cls: type[T], value: Any, name: str) -> T:
    """Build option group ``cls`` from an instance, a dict of its fields or None."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(f"Unknown {name} key(s) {unknown}. Allowed keys: {allowed}.")
        return cls(**value)
    raise ConfigError(
        f"{name} must be a {cls.__name__}, a dict or None; got {type(value).__name__}: {value!r}."
    )


def merge_flat_options(cls: type[T], value: Any, name: str, **flat: Any) -> T:
    """``coerce_config`` plus flat keyword shortcuts; a key given both ways is an error."""
    given = {k: v for k, v in flat.items() if v is not None}
    config = coerce_config(cls, value, name)
    if not given:
        return config
    if value is not None:
        raise ConfigError(
            f"{sorted(given)} given both as keyword argument(s) and inside {name}; "
            f"set each option in one place."
        )
    return dataclasses.replace(config, **given)
