"""How many workers, with which resources, placed how: :class:`ScalingConfig`.

It lives with the launchers (which build worker groups from it) so that
``launchers/`` needs nothing from ``trainer_api/``;
:mod:`polytrain.trainer_api.options.configs` re-exports it next to the other option groups.
"""

from __future__ import annotations

import warnings
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
        use_gpu: reserve GPUs for every worker (one unless ``num_gpus_per_worker`` says
            otherwise) and train on them (nccl for torch backends).
        num_cpus_per_worker: CPUs reserved per worker; also the worker's torch threads.
        resources_per_worker: Ray resources per worker. Its ``"CPU"`` and ``"GPU"``
            entries are folded into ``num_cpus_per_worker`` and ``num_gpus_per_worker``
            (as ray_lightning did): ``{"CPU": 3}`` means 3 CPUs and 3 threads,
            ``{"GPU": 1}`` turns ``use_gpu`` on, ``{"GPU": 0}`` keeps it off. Only the
            custom resources stay in this field. An entry that disagrees with an
            option set to something else than its default is an error.
        placement_strategy: "PACK" (default: as few nodes as possible), "SPREAD",
            "STRICT_PACK" or "STRICT_SPREAD".
        start_timeout_s: fail if the workers cannot be placed within this many seconds.
            None (the default): 30 s, or 15 minutes where an autoscaler may add nodes
            for them (node start-up takes minutes).
        address: the Ray cluster to join ("auto", "ray://...", host:port); None uses a
            running instance or starts a local one.
        min_workers: elastic training: after a failure, go on with as many workers as
            the cluster can hold, down to ``min_workers`` (the global batch stays the
            same, so each worker's batch grows), and grow back to ``num_workers`` at an
            epoch boundary once resources return. None: always ``num_workers``.
        num_gpus_per_worker: GPUs reserved per worker: fractional (0.5: two workers
            share a GPU; use gloo then, nccl cannot share one) or several (2). More
            than 0 implies ``use_gpu``. None (default): 1 with ``use_gpu``, else 0. A
            worker with several GPUs computes on the first one it is given (its
            ``torch.device("cuda", i)``); the others are visible to it for your code.
    """

    num_workers: int = 1
    use_gpu: bool = False
    num_cpus_per_worker: float = 1
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    start_timeout_s: float | None = None
    address: str | None = None
    min_workers: int | None = None
    num_gpus_per_worker: float | None = None

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
        check_number("num_gpus_per_worker", self.num_gpus_per_worker, 0, allow_none=True)
        check_number("start_timeout_s", self.start_timeout_s, 0, allow_none=True)
        self._fold_resources()
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

    @property
    def gpus_per_worker(self) -> float:
        """GPUs one worker reserves: ``num_gpus_per_worker``, else 1 with ``use_gpu``, else 0."""
        if self.num_gpus_per_worker is not None:
            return float(self.num_gpus_per_worker)
        return 1.0 if self.use_gpu else 0.0

    def worker_bundle(self) -> dict[str, float]:
        """The resources one worker reserves (its placement-group bundle)."""
        bundle = {"CPU": float(self.num_cpus_per_worker)}
        if self.gpus_per_worker > 0:
            bundle["GPU"] = self.gpus_per_worker
        bundle.update(self.resources_per_worker or {})
        return bundle

    def trial_bundles(
        self, trainable_resources: dict[str, float] | None = None
    ) -> list[dict[str, float]]:
        """A Ray Tune trial's placement group: bundle 0 for the trial's process, one per worker.

        Every front end's Tune trial (the trainers, the function API, the Lightning
        strategies) reserves this shape; the worker group started inside the trial
        fills bundles 1..n (:func:`~polytrain.launchers.placement.trial_placement_group`).

        Args:
            trainable_resources: bundle 0 (default ``{"CPU": 1}``).

        Raises:
            ConfigError: local mode (``num_workers=0``), which has no workers to place, or
                an empty ``trainable_resources``.
        """
        if self.local_mode:
            raise ConfigError(
                "num_workers must be an int >= 1 for a Tune trial; got 0 (local mode, which "
                "trains inside the trial's process and has no workers to place). Set "
                "num_workers >= 1 (in the trainer or in param_space['scaling_config']), or give "
                "the trainable its resources with tune.with_resources directly."
            )
        head = dict(trainable_resources) if trainable_resources is not None else {"CPU": 1.0}
        if not any(amount > 0 for amount in head.values()):
            raise ConfigError(
                f"trainable_resources must reserve something (e.g. {{'CPU': 1}}); got {head!r}. "
                f"Tune drops an empty bundle 0, and the workers would then look for their "
                f"bundles in the wrong places."
            )
        return [head] + [self.worker_bundle() for _ in range(self.num_workers)]

    def _fold_resources(self) -> None:
        """Move ``resources_per_worker``'s CPU/GPU entries into the typed fields; settle use_gpu."""
        resources = _check_resources(self.resources_per_worker)
        cpus = resources.pop("CPU", None)
        if cpus is not None:
            check_number("resources_per_worker['CPU']", cpus, 0)
            # 1 is the default: a value left there is not a choice that could disagree.
            if self.num_cpus_per_worker not in (1, cpus):
                raise ConfigError(
                    f"resources_per_worker={{'CPU': {cpus!r}}} and num_cpus_per_worker="
                    f"{self.num_cpus_per_worker!r} disagree: set the CPUs per worker in one place."
                )
            self.num_cpus_per_worker = cpus
        gpus = resources.pop("GPU", None)
        if gpus is not None:
            check_number("resources_per_worker['GPU']", gpus, 0)
            if self.num_gpus_per_worker not in (None, gpus):
                raise ConfigError(
                    f"resources_per_worker={{'GPU': {gpus!r}}} and num_gpus_per_worker="
                    f"{self.num_gpus_per_worker!r} disagree: set the GPUs per worker in one place."
                )
            self.num_gpus_per_worker = gpus
        self.resources_per_worker = resources or None
        self._settle_use_gpu()

    def _settle_use_gpu(self) -> None:
        gpus = self.num_gpus_per_worker
        if gpus is None:
            return
        if gpus > 0:
            self.use_gpu = True  # False is the default: GPUs reserved per worker mean GPU use
            if gpus < 1 and self.num_workers > 1:
                warnings.warn(
                    f"num_gpus_per_worker={gpus:g}: workers share GPUs. NCCL cannot run two "
                    f"processes on one GPU; set backend_config={{'dist_backend': 'gloo'}} "
                    f"(ddp) or give each worker a whole GPU.",
                    stacklevel=5,
                )
        elif self.use_gpu:
            raise ConfigError(
                "use_gpu=True but num_gpus_per_worker (or resources_per_worker['GPU']) is 0: "
                "a worker without a GPU cannot train on one. Drop one of the two settings."
            )


def _check_resources(resources: Any) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, dict) or not all(isinstance(k, str) for k in resources):
        raise ConfigTypeError(
            f"resources_per_worker must be a dict of Ray resource names to amounts, e.g. "
            f"{{'CPU': 2, 'GPU': 1, 'custom': 1}}; got {resources!r}."
        )
    for name, amount in resources.items():
        check_number(f"resources_per_worker[{name!r}]", amount, 0)
    return dict(resources)
