"""Lightning 2.x strategies that train on polytrain's Ray worker group with any torch backend.

``Trainer(strategy=RayStrategy(num_workers=2, backend="horovod"))`` runs ``fit``,
``validate``, ``test`` and ``predict`` on Ray actors. Everything distributed is
delegated to the same :class:`~polytrain.backends.Backend` objects the
:class:`~polytrain.TorchTrainer` uses: the driver calls ``on_start`` and
``on_shutdown``; inside every worker the strategy hands the LightningModule and
its optimizers to ``prepare`` and routes ``backward``, ``step``, ``zero_grad``,
``no_sync`` and the consolidated checkpoint state through the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _sync_ddp_if_available,
)
from lightning_fabric.utilities.distributed import group as _group
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor

from polytrain.backends.base import Backend, Components, WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.lightning.environment import WorkerGroupEnvironment

logger = logging.getLogger(__name__)


class RayStrategy(ParallelStrategy):
    """Run a Lightning ``Trainer`` on a group of Ray actors with a polytrain backend.

    Example:
        >>> trainer = pl.Trainer(max_epochs=2, strategy=RayStrategy(num_workers=2))
        >>> trainer.fit(model)  # runs on 2 Ray actors; the driver's model gets the weights

    Every ``fit``/``validate``/``test``/``predict`` call starts a worker group,
    ships a copy of the Trainer and the LightningModule to each actor, runs the
    call there and tears the group down. Afterwards the driver's LightningModule
    holds rank 0's consolidated weights (``fit``), and ``trainer.callback_metrics``,
    ``trainer.logged_metrics``, the checkpoint callbacks (``best_model_path``) and
    the loop counters hold rank 0's values.

    Args:
        backend: a torch backend name or alias ("ddp", "horovod", "fairscale",
            "fsdp", "deepspeed"; see :func:`polytrain.available_backends`) or a
            :class:`~polytrain.backends.Backend` instance.
        num_workers: how many Ray actors train (>= 1).
        use_gpu: one GPU per worker. Leave the Trainer's ``accelerator`` at
            "auto" or "cpu": the driver needs no GPU, the workers pick theirs.
        backend_config: the backend's typed config, or a dict of its fields.
        num_cpus_per_worker: CPUs reserved per worker; also its torch threads.
        resources_per_worker: extra custom Ray resources per worker.
        placement_strategy: "PACK", "SPREAD", "STRICT_PACK" or "STRICT_SPREAD".
        address: the Ray cluster to join; None uses a running instance or starts one.
        start_timeout_s: fail if the workers cannot be placed within this time.
        collective_timeout_s: timeout of one collective (the process-group timeout).
        checkpoint_io: a Lightning ``CheckpointIO`` plugin.
        precision_plugin: a Lightning precision plugin.
    """

    def __init__(
        self,
        backend: str | Backend = "ddp",
        num_workers: int = 1,
        use_gpu: bool = False,
        backend_config: Any = None,
        num_cpus_per_worker: float = 1,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        address: str | None = None,
        start_timeout_s: float = 30.0,
        collective_timeout_s: float = 1800.0,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"num_workers must be an int >= 1 (the number of Ray actors that train); got "
                f"{num_workers!r}. To train in the driver process, use a plain Lightning "
                f"strategy instead of {type(self).__name__}."
            )
        if not isinstance(use_gpu, bool):
            raise ValueError(f"use_gpu must be True or False; got {use_gpu!r}.")
        if (
            isinstance(num_cpus_per_worker, bool)
            or not isinstance(num_cpus_per_worker, (int, float))
            or num_cpus_per_worker <= 0
        ):
            raise ValueError(
                f"num_cpus_per_worker must be a number > 0; got {num_cpus_per_worker!r}."
            )
        self._backend = get_backend(backend, backend_config, framework="torch")
        self._backend.validate_settings(num_workers=num_workers, use_gpu=use_gpu, use_fp16=False)
        super().__init__(
            accelerator=None,
            # The driver's Trainer sees CPU devices whatever the workers use, so that a
            # driver without a GPU can launch GPU workers; each worker picks its device.
            parallel_devices=[torch.device("cpu")] * num_workers,
            cluster_environment=WorkerGroupEnvironment(num_workers),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_workers = num_workers
        self.use_gpu = use_gpu
        self.num_cpus_per_worker = num_cpus_per_worker
        self.resources_per_worker = dict(resources_per_worker or {})
        self.placement_strategy = placement_strategy
        self.address = address
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        # Worker-side state, set once the strategy runs inside an actor.
        self._ctx: WorkerContext | None = None
        self._components: Components | None = None
        self._pending_optimizer_states: list[Any] | None = None
        self._final_model_state: dict[str, Any] | None = None

    # ------------------------------------------------------------ properties
    @property
    def backend(self) -> Backend:
        """The polytrain backend that does the distributed set-up."""
        return self._backend

    @property
    def is_distributed(self) -> bool:
        """True: Lightning adds distributed samplers to the loaders (see ``use_distributed_sampler``)."""
        return True

    @property
    def root_device(self) -> torch.device:
        """The worker's device (CPU, or its GPU with ``use_gpu``); CPU on the driver."""
        if self._ctx is not None:
            return self._ctx.device
        return torch.device("cpu")

    @property
    def num_processes(self) -> int:
        """The number of workers."""
        return self.num_workers

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The shard of the data this worker reads, as the backend distributes samples."""
        if self._ctx is None:
            return {"num_replicas": self.num_workers, "rank": 0}
        num_replicas, rank = self._backend.sample_distribution(self._ctx)
        return {"num_replicas": num_replicas, "rank": rank}

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers as the backend prepared them."""
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._lightning_optimizers = [
            LightningOptimizer._to_lightning_optimizer(opt, self) for opt in optimizers
        ]
        if self._components is not None:
            # LightningModule.optimizer_zero_grad calls optimizer.zero_grad(); the backend
            # decides how to zero (fairscale must zero through the model, Horovod rejects
            # set_to_none). Shadowing the method on the wrapper leaves the optimizer as is.
            for wrapper, optimizer in zip(self._lightning_optimizers, optimizers, strict=True):
                wrapper.zero_grad = functools.partial(self._zero_grad, optimizer)

    def _launcher_env_vars(self) -> dict[str, str]:
        # Lightning's seed_everything() records the seed in PL_* variables; the workers
        # re-seed from them (reset_seed) like processes that Lightning starts itself.
        env = {k: v for k, v in os.environ.items() if k.startswith("PL_")}
        env.update(self._backend.worker_env_vars())
        return env

    def _context_template(self) -> WorkerContext:
        return WorkerContext(
            world_size=self.num_workers,
            use_gpu=self.use_gpu,
            use_fp16=False,  # mixed precision is the Lightning precision plugin's job
            num_cpus=max(1, int(self.num_cpus_per_worker)),
            local_mode=False,
            timeout_s=self.collective_timeout_s,
        )

    def _configure_launcher(self) -> None:
        from polytrain.lightning.launcher import RayLauncher

        self._launcher = RayLauncher(self)

    # ------------------------------------------------------------ worker set-up
    def _set_worker_context(self, rank_info: Any, device_index: int) -> None:
        """Worker: learn this process's ranks and device (called by the launcher)."""
        ctx = dataclasses.replace(
            self._context_template(),
            world_rank=rank_info.world_rank,
            local_rank=rank_info.local_rank,
            world_size=rank_info.world_size,
            local_world_size=rank_info.local_world_size,
            node_rank=rank_info.node_rank,
        )
        if self.use_gpu:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"use_gpu=True but worker rank {ctx.world_rank} sees no CUDA device "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})."
                )
            from pytorch_lightning.accelerators import CUDAAccelerator

            ctx.device = torch.device("cuda", max(device_index, 0))
            self.accelerator = CUDAAccelerator()
        else:
            ctx.device = torch.device("cpu")
        torch.set_num_threads(ctx.num_cpus)
        self._ctx = ctx
        self.parallel_devices = [ctx.device] * ctx.world_size
        assert isinstance(self.cluster_environment, WorkerGroupEnvironment)
        self.cluster_environment.assign(
            ctx.world_rank, ctx.local_rank, ctx.node_rank, ctx.world_size
        )
        rank_zero_only.rank = utils_rank_zero_only.rank = ctx.world_rank

    def setup_environment(self) -> None:
        """Worker: the device; the backend's ``on_start`` already connected the workers."""
        if self._ctx is not None:
            reset_seed()
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """Worker: move the module to the device and let the backend prepare it for fitting.

        For ``validate``/``test``/``predict`` the module is not wrapped: every worker
        received the same weights from the driver and no gradients are exchanged.
        """
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            if self._ctx is not None:
                self._prepare_with_backend()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _prepare_with_backend(self) -> None:
        assert self._ctx is not None and self.model is not None
        components = Components(
            models=[self.model],
            optimizers=list(self.optimizers),
            schedulers=[config.scheduler for config in self.lr_scheduler_configs],
        )
        components.scaler = self._backend.make_scaler(self._ctx)
        with self._backend.worker_scope(self._ctx):
            components = self._backend.prepare(components, self._ctx)
        self._components = components
        self.model = components.models[0]
        # A backend may replace optimizers (Horovod's DistributedOptimizer, fairscale's
        # OSS, a DeepSpeed engine) and rebind the schedulers to them.
        for config, scheduler in zip(
            self.lr_scheduler_configs, components.schedulers, strict=False
        ):
            config.scheduler = scheduler
        self.optimizers = list(components.optimizers)

    def model_to_device(self) -> None:
        """Worker: move the module to this worker's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------ training step
    def _zero_grad(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # set_to_none and friends are the backend's call, not the module's. The backend
        # zeroes every gradient it manages (as in the TorchTrainer): its bookkeeping
        # (fairscale's optimizer-to-model map, Horovod's accumulation count) spans them all.
        assert self._components is not None
        self._backend.zero_grad(self._components)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Worker: the precision plugin's and the module's hooks around the backend's backward."""
        if self._components is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._backend.backward(closure_loss, self._components)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Worker: run the closure through the precision plugin, then the backend's step."""
        if self._components is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        stepper = _BackendStep(optimizer, self._backend, self._components)
        return self.precision_plugin.optimizer_step(stepper, model=model, closure=closure, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Worker: the backend's no-sync context, for gradient accumulation."""
        if self._components is None:
            yield None
            return
        with self._backend.no_sync(self._components):
            yield None

    # ------------------------------------------------------------ collectives
    # Lightning's own collectives (self.log(sync_dist=True), torchmetrics, barriers)
    # use torch.distributed; the launcher makes sure a process group exists even
    # when the backend talks through something else (Horovod).
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Worker: all-reduce a tensor across the workers (mean by default)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Worker: wait until every worker arrives."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Worker: send a picklable object from rank ``src`` to every worker."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Worker: gather a tensor from every worker."""
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Worker: the consolidated module state (every rank takes part; rank 0's is full).

        Sharded backends gather here, so checkpoints are plain LightningModule state
        dicts that load anywhere.
        """
        if self._components is None or self._ctx is None:
            return super().lightning_module_state_dict()
        with self._backend.worker_scope(self._ctx):
            full = self._backend.full_state_dict(self._components, self._ctx)
        if full is None:
            self._pending_optimizer_states = None
            return super().lightning_module_state_dict()
        self._pending_optimizer_states = list(full["optimizers"])
        return full["models"][0]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Worker: the optimizer's consolidated state, gathered with the module state."""
        if self._components is None:
            return super().optimizer_state(optimizer)
        if not self.is_global_zero or self._pending_optimizer_states is None:
            return {}  # only rank 0 writes checkpoints
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        index = _index_of(optimizer, self._components.optimizers)
        return self._pending_optimizer_states[index]

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Worker: resume optimizer states from a consolidated checkpoint, through the backend."""
        if self._components is None or self._ctx is None:
            return super().load_optimizer_state_dict(checkpoint)
        state = {
            "models": [checkpoint["state_dict"]],
            "optimizers": checkpoint.get("optimizer_states"),
        }
        with self._backend.worker_scope(self._ctx):
            self._backend.load_full_state_dict(self._components, state, self._ctx)

    def teardown(self) -> None:
        """Worker: keep rank 0's consolidated weights for the driver, then unwrap the module."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if (
            self._components is not None
            and self._ctx is not None
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            # INTERRUPTED when a worker raised: its peers may never reach a gather.
            and trainer.state.status == TrainerStatus.RUNNING
        ):
            with self._backend.worker_scope(self._ctx):
                full = self._backend.full_state_dict(self._components, self._ctx)
            self._final_model_state = full["models"][0] if full is not None else None
        self._components = None
        if module is not None:
            self.model = module
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_components"] = None  # worker-only objects never travel
        return state


class _BackendStep:
    """Stands in for an optimizer in the precision plugin: ``step`` is the backend's step."""

    def __init__(self, optimizer: Any, backend: Backend, components: Components) -> None:
        self._optimizer = optimizer
        self._backend = backend
        self._components = components
        self._index = _index_of(optimizer, components.optimizers)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self._backend.step(self._components, self._index)
        return result

    def __getattr__(self, name: str) -> Any:
        # param_groups, state, ...: gradient clipping and scalers read the real optimizer.
        return getattr(self._optimizer, name)


def _index_of(optimizer: Any, optimizers: list[Any]) -> int:
    for index, candidate in enumerate(optimizers):
        if candidate is optimizer:
            return index
    raise RuntimeError(
        f"Optimizer {type(optimizer).__name__} is not one of the optimizers the backend "
        f"prepared ({[type(o).__name__ for o in optimizers]}); step the optimizers that "
        f"LightningModule.optimizers() returns."
    )


class RayHorovodStrategy(RayStrategy):
    """:class:`RayStrategy` with ``backend="horovod"`` (Horovod ring-allreduce over gloo).

    Lightning 2.x dropped its own Horovod strategy; this one runs Horovod through
    polytrain's backend. Takes the arguments of :class:`RayStrategy` except ``backend``.
    """

    def __init__(self, num_workers: int = 1, use_gpu: bool = False, **kwargs: Any) -> None:
        _reject_backend(type(self).__name__, kwargs)
        super().__init__(backend="horovod", num_workers=num_workers, use_gpu=use_gpu, **kwargs)


class RayShardedStrategy(RayStrategy):
    """:class:`RayStrategy` with ``backend="fairscale"`` (optimizer-state sharding).

    Lightning 2.x dropped its fairscale strategies; this one runs fairscale's OSS +
    ShardedDataParallel through polytrain's backend. Takes the arguments of
    :class:`RayStrategy` except ``backend``.
    """

    def __init__(self, num_workers: int = 1, use_gpu: bool = False, **kwargs: Any) -> None:
        _reject_backend(type(self).__name__, kwargs)
        super().__init__(backend="fairscale", num_workers=num_workers, use_gpu=use_gpu, **kwargs)


class RayDeepSpeedStrategy(RayStrategy):
    """:class:`RayStrategy` with ``backend="deepspeed"`` (DeepSpeed ZeRO; ``backend_config`` picks the stage).

    Takes the arguments of :class:`RayStrategy` except ``backend``.
    """

    def __init__(self, num_workers: int = 1, use_gpu: bool = False, **kwargs: Any) -> None:
        _reject_backend(type(self).__name__, kwargs)
        super().__init__(backend="deepspeed", num_workers=num_workers, use_gpu=use_gpu, **kwargs)


def _reject_backend(name: str, kwargs: dict[str, Any]) -> None:
    if "backend" in kwargs:
        raise TypeError(
            f"{name} fixes the backend; got backend={kwargs['backend']!r}. Use "
            f"RayStrategy(backend={kwargs['backend']!r}, ...) to choose another one."
        )
