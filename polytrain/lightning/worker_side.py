"""The worker side of a RayStrategy: one actor's backend strategy, context and components.

Inside every actor the Lightning strategy hands the LightningModule and its
optimizers to the backend's :class:`~polytrain.backends.core.strategy.TorchStrategy`
through the same :meth:`~polytrain.backends.core.strategy.TorchStrategy.setup`
sequence the trainers use, and routes zeroing, backward, steps, gradient-sync
skipping and the consolidated checkpoint state through it. Nothing here travels
between processes: the driver's strategy holds no :class:`WorkerSide`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy


class WorkerSide:
    """What one actor of a RayStrategy holds once it knows its ranks and device.

    Args:
        strategy: the backend's worker-side strategy, created in this actor.
        ctx: this worker's placed context (ranks and device).

    Attributes:
        components: the module, optimizers and schedulers as the backend prepared
            them; None before :meth:`setup` (and outside ``fit``) and after :meth:`release`.
    """

    def __init__(self, strategy: TorchStrategy, ctx: WorkerContext) -> None:
        self.strategy = strategy
        self.ctx = ctx
        self.components: Components | None = None
        # Gathered with the module state, handed out per optimizer by optimizer_state().
        self._pending_optimizer_states: list[Any] | None = None

    @classmethod
    def start(
        cls, backend: Backend, template: WorkerContext, rank_info: Any, device_index: int
    ) -> WorkerSide:
        """Place ``template`` at this worker's ranks and device; create the backend's strategy here.

        Args:
            backend: the strategy's backend (a torch backend).
            template: the group's context (:meth:`~polytrain.backends.core.context.WorkerContext.from_scaling`).
            rank_info: this worker's :class:`~polytrain.launchers.ranks.RankInfo`.
            device_index: its CUDA device among those it sees (-1: none).

        Raises:
            RuntimeError: ``use_gpu`` is set but this worker sees no CUDA device.
        """
        ctx = template.place(rank_info, device_index)
        torch.set_num_threads(ctx.num_cpus)
        strategy = backend.make_strategy()
        assert isinstance(strategy, TorchStrategy), f"{backend!r} is not a torch backend"
        return cls(strategy, ctx)

    @property
    def prepared(self) -> bool:
        """True between :meth:`setup` and :meth:`release`."""
        return self.components is not None

    def sample_distribution(self) -> tuple[int, int]:
        """``(num_replicas, rank)``: the shard of the data this worker reads."""
        return self.strategy.sample_distribution(self.ctx)

    def setup(
        self, model: torch.nn.Module, optimizers: list[Any], scheduler_configs: list[Any]
    ) -> Components:
        """Let the backend prepare the module and optimizers (precision + ``prepare``).

        A backend may replace the optimizers (Horovod's DistributedOptimizer,
        fairscale's OSS, a DeepSpeed engine) and rebind the schedulers to them: each
        of Lightning's ``scheduler_configs`` is pointed at the scheduler the backend returned.
        """
        components = Components(
            models=[model],
            optimizers=list(optimizers),
            schedulers=[config.scheduler for config in scheduler_configs],
        )
        self.components = self.strategy.setup(components, self.ctx)
        for config, scheduler in zip(scheduler_configs, self.components.schedulers, strict=False):
            config.scheduler = scheduler
        return self.components

    def release(self) -> None:
        """Forget the prepared components (the module goes back to Lightning)."""
        self.components = None
        self._pending_optimizer_states = None

    # ------------------------------------------------------------ training step
    def zero_grad(self) -> None:
        """Zero every gradient the backend manages (its bookkeeping spans all optimizers)."""
        self.strategy.zero_grad(self._prepared())

    def backward(self, loss: torch.Tensor) -> None:
        """The backend's backward (engines, allreduce hooks)."""
        self.strategy.backward(loss, self._prepared())

    def stepper(self, optimizer: Any) -> BackendStep:
        """An optimizer stand-in whose ``step`` is the backend's step of ``optimizer``."""
        return BackendStep(optimizer, self.strategy, self._prepared())

    def no_sync(self) -> contextlib.AbstractContextManager:
        """The backend's context in which backward passes do not synchronise gradients."""
        return self.strategy.no_sync(self._prepared())

    # ------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, Any] | None:
        """The consolidated state (every rank takes part; rank 0's is full, others may be None)."""
        with self.strategy.worker_scope(self.ctx):
            return self.strategy.full_state_dict(self._prepared(), self.ctx)

    def gather_module_state(self) -> dict[str, Any] | None:
        """The consolidated module state; keeps the optimizer states for :meth:`optimizer_state`.

        None when the backend has no consolidated state on this rank.
        """
        full = self.full_state_dict()
        if full is None:
            self._pending_optimizer_states = None
            return None
        self._pending_optimizer_states = list(full["optimizers"])
        return full["models"][0]

    def final_module_state(self) -> dict[str, Any] | None:
        """The consolidated module state at the end of ``fit`` (rank 0; None elsewhere)."""
        full = self.full_state_dict()
        return full["models"][0] if full is not None else None

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s consolidated state, gathered with the module state (rank 0 only)."""
        if self.ctx.world_rank != 0 or self._pending_optimizer_states is None:
            return {}  # only rank 0 writes checkpoints
        index = index_of(optimizer, self._prepared().optimizers)
        return self._pending_optimizer_states[index]

    def load_checkpoint_state(self, checkpoint: dict[str, Any]) -> None:
        """Load a Lightning checkpoint's module and optimizer states through the backend."""
        state = {
            "models": [checkpoint["state_dict"]],
            "optimizers": checkpoint.get("optimizer_states"),
        }
        with self.strategy.worker_scope(self.ctx):
            self.strategy.load_full_state_dict(self._prepared(), state, self.ctx)

    def _prepared(self) -> Components:
        assert self.components is not None, "the backend has not prepared the components"
        return self.components

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["components"] = None  # wrapped modules, engines, communicators stay here
        state["_pending_optimizer_states"] = None
        return state


class BackendStep:
    """Stands in for an optimizer in the precision plugin: ``step`` is the backend's step."""

    def __init__(self, optimizer: Any, strategy: TorchStrategy, components: Components) -> None:
        self._optimizer = optimizer
        self._strategy = strategy
        self._components = components
        self._index = index_of(optimizer, components.optimizers)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the closure (forward + backward), then the backend's step of this optimizer."""
        result = closure() if closure is not None else None
        self._strategy.step(self._components, self._index)
        return result

    def __getattr__(self, name: str) -> Any:
        # param_groups, state, ...: gradient clipping and scalers read the real optimizer.
        return getattr(self._optimizer, name)


def index_of(optimizer: Any, optimizers: list[Any]) -> int:
    """The position of ``optimizer`` (by identity) among the prepared ``optimizers``.

    Raises:
        RuntimeError: ``optimizer`` is not one of them.
    """
    for index, candidate in enumerate(optimizers):
        if candidate is optimizer:
            return index
    raise RuntimeError(
        f"Optimizer {type(optimizer).__name__} is not one of the optimizers the backend "
        f"prepared ({[type(o).__name__ for o in optimizers]}); step the optimizers that "
        f"LightningModule.optimizers() returns."
    )
