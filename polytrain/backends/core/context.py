"""What a worker knows about itself and what its creators built (worker side).

:class:`WorkerContext` travels from the driver to every worker (its rank fields
filled in there); :class:`Components` holds the objects the creators built in one
worker, as the backend's strategy prepared them. Neither imports a framework at
module level: TensorFlow workers must not pay for importing torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.step_options import StepOptions

if TYPE_CHECKING:
    import torch


class _DeviceField:
    """The ``device`` field of :class:`WorkerContext`: ``torch.device("cpu")`` unless set.

    torch is imported only when a worker reads the default: a context travels to
    every worker, and TensorFlow workers must not pay for importing torch.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return None  # the dataclass default: "not set"
        value = obj.__dict__.get(self._attr)
        if value is None:
            import torch

            value = torch.device("cpu")
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._attr] = value


@dataclass
class WorkerContext:
    """What a worker knows about its place in the group (worker side).

    ``device`` is the torch device the worker computes on (the CPU unless set);
    ``step`` the training step's clipping, accumulation and precision options.
    """

    world_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    use_gpu: bool = False
    use_fp16: bool = False
    num_cpus: int = 1
    local_mode: bool = False
    device: torch.device = _DeviceField()  # type: ignore[assignment]
    timeout_s: float = 1800.0
    step: StepOptions = field(default_factory=StepOptions)

    @classmethod
    def from_scaling(
        cls,
        scaling: Any,
        *,
        world_size: int | None = None,
        use_fp16: bool = False,
        timeout_s: float = 1800.0,
        step: StepOptions | None = None,
    ) -> WorkerContext:
        """Driver: the context every worker of a group starts from, before it is placed.

        The one template of the trainers and the Lightning strategies: each worker then
        calls ``template.place(rank_info, device_index)`` for its ranks and device.

        Args:
            scaling: the group's :class:`~polytrain.launchers.scaling.ScalingConfig`.
            world_size: the group's size when it differs from ``scaling`` (elastic trainers).
            use_fp16: the backend's own mixed precision (the Lightning strategies leave it
                to Lightning's precision plugin).
            timeout_s: the timeout of one collective.
            step: the training step's options (its mixed ``precision`` turns ``use_fp16`` on).
        """
        from polytrain.launchers.torchrun import torchrun_world

        step = step if step is not None else StepOptions()
        # Local mode under torchrun: the in-process worker is a rank of torchrun's world,
        # in its process group, so the backends wrap and shard as in any worker.
        local_mode = scaling.local_mode and torchrun_world() is None
        return cls(
            world_size=max(world_size if world_size is not None else scaling.world_size, 1),
            use_gpu=scaling.use_gpu,
            use_fp16=use_fp16 or step.mixed,
            num_cpus=int(scaling.num_cpus_per_worker) or 1,
            local_mode=local_mode,
            timeout_s=timeout_s,
            step=step,
        )

    def for_rank(self, info: Any) -> WorkerContext:
        """A copy placed at ``info``'s ranks (a :class:`~polytrain.launchers.ranks.RankInfo`)."""
        # A shallow copy, not dataclasses.replace: that reads every field, and reading an
        # unset device would import torch in a TensorFlow worker.
        placed = copy.copy(self)
        placed.world_rank = info.world_rank
        placed.local_rank = info.local_rank
        placed.world_size = info.world_size
        placed.local_world_size = info.local_world_size
        placed.node_rank = info.node_rank
        return placed

    def place(self, info: Any, device_index: int) -> WorkerContext:
        """Worker: a copy at ``info``'s ranks, computing on its CUDA device or the CPU.

        Args:
            info: a :class:`~polytrain.launchers.ranks.RankInfo`.
            device_index: the worker's CUDA device among those it sees (-1: none assigned).

        Raises:
            RuntimeError: ``use_gpu`` is set but this worker sees no CUDA device.
        """
        import os

        import torch

        placed = self.for_rank(info)
        if not placed.use_gpu:
            placed.device = torch.device("cpu")
            return placed
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"use_gpu=True but worker rank {placed.world_rank} sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})."
            )
        placed.device = torch.device("cuda", max(device_index, 0))
        return placed

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one worker to talk to."""
        return self.world_size > 1


@dataclass
class Components:
    """The objects the creators built in one worker, as the backend prepared them."""

    models: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    criterion: Callable | None = None
    schedulers: list[Any] = field(default_factory=list)
    train_loader: Any = None
    val_loader: Any = None
    precision: Any = None  # a polytrain.backends.core.precision.Precision (torch workers)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-owned state (engines, ...)

    @property
    def scaler(self) -> Any:
        """The gradient scaler of the precision plugin (``None`` when gradients are not scaled)."""
        return getattr(self.precision, "scaler", None)

    @property
    def model(self) -> torch.nn.Module:
        """The first (usually the only) model."""
        return self.models[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first (usually the only) optimizer."""
        return self.optimizers[0]
