"""How many workers, with which resources, placed how: :class:`ScalingConfig`.

It lives with the launchers (which build worker groups from it) so that
``launchers/`` needs nothing from ``trainer_api/``;
:mod:`polytrain.trainer_api.config` re-exports it next to the other option groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise unless ``value`` is an int (not a bool) of at least ``minimum``.

    Raises:
        ConfigTypeError: not an int.
        ConfigError: an int below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"{name} must be an int >= {minimum}; got {type(value).__name__}: {value!r}."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}.")


def check_number(name: str, value: Any, minimum: float, allow_none: bool = False) -> None:
    """Raise unless ``value`` is a number (not a bool) of at least ``minimum`` (or allowed None).

    Raises:
        ConfigTypeError: not a number.
        ConfigError: a number below ``minimum``.
    """
    if value is None and allow_none:
        return
    message = (
        f"{name} must be a number >= {minimum}{' or None' if allow_none else ''}; got {value!r}."
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(message)
    if value < minimum:
        raise ConfigError(message)


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
        check_int("num_workers", self.num_workers, 0)
        if self.min_workers is not None:
            check_int("min_workers", self.min_workers, 1)
            if self.min_workers > max(self.num_workers, 1) or self.num_workers == 0:
                raise ConfigError(
                    f"min_workers={self.min_workers} must be between 1 and num_workers="
                    f"{self.num_workers} (and num_workers >= 1: local mode is not elastic)."
                )
        if not isinstance(self.use_gpu, bool):
            raise ConfigTypeError(f"use_gpu must be True or False; got {self.use_gpu!r}.")
        check_number("num_cpus_per_worker", self.num_cpus_per_worker, 0)
        check_number("start_timeout_s", self.start_timeout_s, 0)
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

    def worker_bundle(self) -> dict[str, float]:
        """The resources one worker reserves (its placement-group bundle)."""
        bundle = {"CPU": float(self.num_cpus_per_worker)}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        bundle.update(self.resources_per_worker or {})
        return bundle
