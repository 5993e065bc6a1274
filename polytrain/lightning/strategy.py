"""Lightning 2.x strategies that train on polytrain's Ray worker group with any torch backend.

``Trainer(strategy=RayStrategy(num_workers=2, backend="horovod"))`` runs ``fit``,
``validate``, ``test`` and ``predict`` on Ray actors, built from the same pieces as
the :class:`~polytrain.TorchTrainer`: the group comes from
:func:`polytrain.launchers.factory.make_group` and is connected by the backend's
rendezvous (:mod:`polytrain.lightning.launcher`); in every worker the backend's
strategy prepares, steps and checkpoints the module (:mod:`polytrain.lightning.worker_side`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import RunningStage, TrainerFn, TrainerStatus
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.ddp.config import ddp_options
from polytrain.backends.registry import get_backend
from polytrain.compat.deprecation import DRAIN_WORD, renamed
from polytrain.launchers.scaling import ScalingConfig
from polytrain.launchers.worker import report_progress
from polytrain.lightning.collectives import TorchCollectives
from polytrain.lightning.environment import WorkerGroupEnvironment
from polytrain.lightning.options import (
    check_init_hook,
    check_max_drains,
    check_max_retries,
    resolve_scaling,
    scaling_field,
    with_ddp_kwargs,
)
from polytrain.lightning.worker_side import WorkerSide
from polytrain.runs.policies.drain import DrainPolicy
from polytrain.runs.policies.failure import FailurePolicy


class RayStrategy(TorchCollectives, ParallelStrategy):
    """Run a Lightning ``Trainer`` on a group of Ray actors with a polytrain backend.

    Example:
        >>> trainer = pl.Trainer(max_epochs=2, strategy=RayStrategy(num_workers=2))
        >>> trainer.fit(model)  # runs on 2 Ray actors; the driver's model gets the weights
        >>> RayStrategy(backend="horovod", scaling_config=ScalingConfig(num_workers=4))

    Every ``fit``/``validate``/``test``/``predict`` call starts a worker group,
    ships a copy of the Trainer and the LightningModule to each actor, runs the
    call there and tears the group down. Afterwards the driver's LightningModule
    holds rank 0's consolidated weights (``fit``), and ``trainer.callback_metrics``,
    ``trainer.logged_metrics``, the checkpoint callbacks (``best_model_path``) and
    the loop counters hold rank 0's values. A worker lost during a call is replaced by
    a new group (``max_retries``); a ``fit`` resumes from Lightning's newest checkpoint.
    A node of the group that drains (Ray's announced loss of a node) is left without
    losing a step: the fit stops at a batch boundary on every worker, checkpoints there
    and continues in a new group off the node (``max_drains``).

    Args:
        backend: a torch backend name or alias ("ddp", "horovod", "fairscale",
            "fsdp", "deepspeed"; see :func:`polytrain.available_backends`) or a
            :class:`~polytrain.backends.Backend` instance.
        num_workers: how many Ray actors train (>= 1; default 1).
        use_gpu: one GPU per worker. Leave the Trainer's ``accelerator`` at
            "auto" or "cpu": the driver needs no GPU, the workers pick theirs.
        backend_config: the backend's typed config, or a dict of its fields.
        num_cpus_per_worker: CPUs reserved per worker; also its torch threads (default 1).
        resources_per_worker: Ray resources per worker; ``"CPU"`` and ``"GPU"`` entries
            set ``num_cpus_per_worker`` and ``num_gpus_per_worker`` (as in ray_lightning).
        placement_strategy: "PACK" (default), "SPREAD", "STRICT_PACK" or "STRICT_SPREAD".
        address: the Ray cluster to join; None uses a running instance or starts one.
        start_timeout_s: fail if the workers cannot be placed within this time (default: 30 s,
            or minutes when an autoscaler may add nodes).
        collective_timeout_s: timeout of one collective (the process-group timeout).
        checkpoint_io: a Lightning ``CheckpointIO`` plugin.
        precision_plugin: a Lightning precision plugin.
        scaling_config: the workers, their resources and placement, as for the trainers:
            a :class:`~polytrain.launchers.scaling.ScalingConfig` or a dict of its
            fields (``min_workers`` must stay None). ``num_workers``, ``use_gpu``,
            ``num_cpus_per_worker``, ``resources_per_worker``, ``placement_strategy``,
            ``address``, ``start_timeout_s`` and ``num_gpus_per_worker`` are shortcuts
            for its fields: give each option in one place.
        num_gpus_per_worker: GPUs per worker: fractional or several (> 0 implies
            ``use_gpu``; a worker computes on the first GPU it is given).
        init_hook: a function (no arguments) run on every worker when the group has
            started, before the workers connect and before training: environment
            variables, logging, seeds. It must be picklable (a lambda or closure works).
        max_retries: restarts of the worker group after a lost worker (killed, out of
            memory, node gone), over the strategy's life, before the error is raised;
            0 raises at the first loss. 3 by default, as ``FailureConfig.max_retries``
            of the trainers. A restarted ``fit`` continues from the newest checkpoint
            Lightning wrote during the call (a ``ModelCheckpoint``'s ``last.ckpt`` or
            newest file), or from the start when there is none; ``validate``, ``test``
            and ``predict`` run again. An exception raised by user code is never
            retried. See docs/lightning.md, "Lost workers".
        max_drains: drained nodes (Ray's announced loss of a node) a call may move off,
            over the strategy's life, counted apart from ``max_retries``; None (the
            default) is unlimited, as ``FailureConfig.max_drains``. A ``fit`` stops at
            the next batch boundary on every worker, writes a checkpoint there (under
            ``<default_root_dir>/drain_checkpoints``, with the train loaders' position) and
            continues from it in a new group off the node, with no step lost or repeated;
            ``validate``, ``test`` and ``predict`` run again off the node. The drain past
            the limit still checkpoints, then raises ``DrainLimitError`` with the path.
            See docs/lightning.md, "Drained nodes".
        max_preemptions: the former name of ``max_drains`` (deprecated).
        **ddp_kwargs: keyword arguments of ``DistributedDataParallel`` (e.g.
            ``find_unused_parameters=True, bucket_cap_mb=50``), as ray_lightning took
            them; they go to the ``ddp`` backend's ``ddp_kwargs`` (see
            :class:`~polytrain.backends.ddp.config.DDPConfig`), checked against DDP's signature.

    Raises:
        polytrain.errors.ConfigError: an option that is not allowed (a ``ValueError``).
        polytrain.errors.ConfigTypeError: an unknown keyword argument, or a DDP keyword
            argument with a backend that does not use DDP (a ``TypeError``).
    """

    def __init__(
        self,
        backend: str | Backend = "ddp",
        num_workers: int | None = None,
        use_gpu: bool | None = None,
        backend_config: Any = None,
        num_cpus_per_worker: float | None = None,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str | None = None,
        address: str | None = None,
        start_timeout_s: float | None = None,
        collective_timeout_s: float = 1800.0,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        scaling_config: ScalingConfig | dict | None = None,
        num_gpus_per_worker: float | None = None,
        init_hook: Callable[[], None] | None = None,
        max_retries: int = 3,
        max_drains: int | None = None,
        max_preemptions: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        name = type(self).__name__
        self.max_retries = check_max_retries(name, max_retries)
        self.max_drains = check_max_drains(name, max_drains, max_preemptions)
        self.failure_policy, self.drain_policy = _policies(name, self.max_retries, self.max_drains)
        self.scaling = resolve_scaling(
            name,
            scaling_config,
            num_workers=num_workers,
            use_gpu=use_gpu,
            num_cpus_per_worker=num_cpus_per_worker,
            resources_per_worker=resources_per_worker,
            placement_strategy=placement_strategy,
            address=address,
            start_timeout_s=start_timeout_s,
            num_gpus_per_worker=num_gpus_per_worker,
        )
        self.init_hook = check_init_hook(name, init_hook)
        backend_obj = get_backend(backend, backend_config, framework="torch")
        # Through ddp_options, whose signature shows LightningCLI the DDP arguments.
        options = ddp_options(**ddp_kwargs)
        self._backend = with_ddp_kwargs(name, _own_arguments(), backend_obj, options)
        self._backend.validate_settings(
            num_workers=self.scaling.num_workers, use_gpu=self.scaling.use_gpu, use_fp16=False
        )
        super().__init__(
            accelerator=None,
            # The driver's Trainer sees CPU devices whatever the workers use, so that a
            # driver without a GPU can launch GPU workers; each worker picks its device.
            parallel_devices=[torch.device("cpu")] * self.scaling.num_workers,
            cluster_environment=WorkerGroupEnvironment(self.scaling.num_workers),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.collective_timeout_s = collective_timeout_s
        # Worker-side state: set once the strategy runs inside an actor, never shipped back.
        self._worker: WorkerSide | None = None
        self._final_model_state: dict[str, Any] | None = None

    #: Worker: the train loaders' positions in checkpoints (the launcher sets it for a fit).
    _loader_positions: Any = None

    # ------------------------------------------------------------ properties
    num_workers = scaling_field("num_workers", "How many Ray actors train.")
    use_gpu = scaling_field("use_gpu", "Whether every worker trains on a GPU of its own.")
    num_cpus_per_worker = scaling_field("num_cpus_per_worker", "CPUs reserved per worker.")
    placement_strategy = scaling_field("placement_strategy", "How the workers are placed.")
    address = scaling_field("address", "The Ray cluster to join (None: a local one).")
    start_timeout_s = scaling_field("start_timeout_s", "How long placing the workers may take.")
    num_gpus_per_worker = scaling_field("gpus_per_worker", "GPUs reserved per worker.")

    @property
    def resources_per_worker(self) -> dict[str, float]:
        """Custom Ray resources per worker (CPU and GPU entries are folded into the fields)."""
        return dict(self.scaling.resources_per_worker or {})

    @property
    def num_restarts(self) -> int:
        """Restarts of the worker group after a lost worker so far (at most ``max_retries``)."""
        return self.failure_policy.num_restarts

    @property
    def num_drains(self) -> int:
        """Drained nodes moved off so far (at most ``max_drains``; not in ``num_restarts``)."""
        return self.drain_policy.count

    @property
    def num_preemptions(self) -> int:
        """Deprecated name of :attr:`num_drains`."""
        renamed("num_preemptions", "num_drains", DRAIN_WORD)
        return self.num_drains

    @property
    def max_preemptions(self) -> int | None:
        """Deprecated name of :attr:`max_drains`."""
        return self.max_drains

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
        if self._worker is not None:
            return self._worker.ctx.device
        return torch.device("cpu")

    @property
    def num_processes(self) -> int:
        """The number of workers."""
        return self.num_workers

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The shard of the data this worker reads, as the backend distributes samples."""
        if self._worker is None:
            return {"num_replicas": self.num_workers, "rank": 0}
        num_replicas, rank = self._worker.sample_distribution()
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
        if self._prepared() is not None:
            # LightningModule.optimizer_zero_grad calls optimizer.zero_grad(); the backend
            # decides how to zero (fairscale must zero through the model, Horovod rejects
            # set_to_none). Lightning's automatic loop hands the hook the optimizer itself
            # (trainer.optimizers), not the wrapper: that one zeroes in place. With torch's
            # set_to_none, fairscale's sddp left LoRA adapters apart from one process's from
            # the second step on; routing it to the backend's zeroing (the wrapper's) made
            # the digits model's gradient norm grow step after step (0.4, 3.2, 11 at
            # batches 0, 10, 20; Lightning zeroes between the forward and the backward).
            for wrapper, optimizer in zip(self._lightning_optimizers, optimizers, strict=True):
                wrapper.zero_grad = functools.partial(self._zero_grad, optimizer)
                _zero_in_place(optimizer)

    def _prepared(self) -> WorkerSide | None:
        """The worker side once the backend prepared the components (None otherwise)."""
        worker = self._worker
        return worker if worker is not None and worker.prepared else None

    # ------------------------------------------------------------ driver side
    def _context_template(self) -> WorkerContext:
        # use_fp16=False: mixed precision is the Lightning precision plugin's job.
        return WorkerContext.from_scaling(
            self.scaling, use_fp16=False, timeout_s=self.collective_timeout_s
        )

    def _configure_launcher(self) -> None:
        from polytrain.lightning.launcher import RayLauncher

        self._launcher = RayLauncher(self)

    # ------------------------------------------------------------ worker set-up
    def _set_worker_context(self, rank_info: Any, device_index: int) -> None:
        """Worker: learn this process's ranks and device (called by the launcher)."""
        self._worker = WorkerSide.start(
            self._backend, self._context_template(), rank_info, device_index
        )
        ctx = self._worker.ctx
        if ctx.device.type == "cuda":
            from pytorch_lightning.accelerators import CUDAAccelerator

            self.accelerator = CUDAAccelerator()
        self.parallel_devices = [ctx.device] * ctx.world_size
        assert isinstance(self.cluster_environment, WorkerGroupEnvironment)
        self.cluster_environment.assign(
            ctx.world_rank, ctx.local_rank, ctx.node_rank, ctx.world_size
        )
        rank_zero_only.rank = utils_rank_zero_only.rank = ctx.world_rank

    def setup_environment(self) -> None:
        """Worker: the device; the backend's rendezvous already connected the workers."""
        if self._worker is not None:
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
            if self._worker is not None:
                components = self._worker.setup(
                    self.model, self.optimizers, self.lr_scheduler_configs
                )
                self.model = components.models[0]
                self.optimizers = list(components.optimizers)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def process_dataloader(self, dataloader: Any) -> Any:
        """Worker: a train loader of a fit keeps its position in the epoch for checkpoints.

        See :class:`~polytrain.lightning.drains.ResumableLoaders`: the loader counts the
        batches it yielded this epoch, and a fit resumed from a mid-epoch checkpoint
        continues with the next batch. Other loaders, and a loader with a
        ``state_dict`` of its own, are returned as they are.
        """
        positions = self._loader_positions
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if positions is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return positions.track(dataloader)

    def model_to_device(self) -> None:
        """Worker: move the module to this worker's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------ training step
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Worker: record where training is, for the driver's monitor calls (as the trainers do)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if self._worker is None or trainer is None:
            return
        total = trainer.num_training_batches
        report_progress(
            batch_idx,
            total if isinstance(total, int) else None,  # inf for an iterable without length
            phase="train",
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
        )

    def _zero_grad(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # set_to_none and friends are the backend's call, not the module's. The backend
        # zeroes every gradient it manages (as in the TorchTrainer): its bookkeeping
        # (fairscale's optimizer-to-model map, Horovod's accumulation count) spans them all.
        worker = self._prepared()
        assert worker is not None
        worker.zero_grad()

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Worker: the precision plugin's and the module's hooks around the backend's backward."""
        worker = self._prepared()
        if worker is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        worker.backward(closure_loss)
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
        worker = self._prepared()
        if worker is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        stepper = worker.stepper(_unwrap_optimizer(optimizer))
        return self.precision_plugin.optimizer_step(stepper, model=model, closure=closure, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Worker: the backend's no-sync context, for gradient accumulation."""
        worker = self._prepared()
        if worker is None:
            yield None
            return
        with worker.no_sync():
            yield None

    # ------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Worker: the consolidated module state (every rank takes part; rank 0's is full).

        Sharded backends gather here, so checkpoints are plain LightningModule state
        dicts that load anywhere.
        """
        worker = self._prepared()
        state = worker.gather_module_state() if worker is not None else None
        return state if state is not None else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Worker: the optimizer's consolidated state, gathered with the module state."""
        worker = self._prepared()
        if worker is None:
            return super().optimizer_state(optimizer)
        return worker.optimizer_state(_unwrap_optimizer(optimizer))

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Worker: resume optimizer states from a consolidated checkpoint, through the backend."""
        worker = self._prepared()
        if worker is None:
            return super().load_optimizer_state_dict(checkpoint)
        worker.load_checkpoint_state(checkpoint)

    def teardown(self) -> None:
        """Worker: keep rank 0's consolidated weights for the driver, then unwrap the module."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        worker = self._prepared()
        if (
            worker is not None
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            # INTERRUPTED when a worker raised: its peers may never reach a gather.
            and trainer.state.status == TrainerStatus.RUNNING
        ):
            self._final_model_state = worker.final_module_state()
        if worker is not None:
            worker.release()
        if module is not None:
            self.model = module
        super().teardown()


def _unwrap_optimizer(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _own_arguments() -> list[str]:
    skip = ("self", "ddp_kwargs")
    return [p for p in inspect.signature(RayStrategy.__init__).parameters if p not in skip]


def _policies(name: str, max_retries: int, max_drains: int | None) -> tuple[Any, Any]:
    """Lost workers and drains over the strategy's life: the run loop's policies.

    Kept by the strategy (:mod:`polytrain.runs.policies`), so that the counts go on
    across the calls' worker groups.
    """
    return (
        FailurePolicy(max_retries, option=f"{name} max_retries"),
        DrainPolicy(max_drains, f"{name} max_drains"),
    )


def _zero_in_place(optimizer: Any) -> None:
    """Make ``optimizer.zero_grad()`` zero the gradients in place (``set_to_none=False``).

    Gradients that are views into a backend's buffers (fairscale's reduce buckets) stay
    attached to them. An optimizer whose ``zero_grad`` takes no ``set_to_none`` (Horovod's
    ``DistributedOptimizer``) keeps its own.
    """
    own = type(optimizer).zero_grad
    if "set_to_none" not in inspect.signature(own).parameters:
        return
    optimizer.zero_grad = functools.partial(own, optimizer, set_to_none=False)
