"""Entry points the TorchTrainer runs inside every worker (through the worker group).

Each function is module-level (so it pickles by reference) and keeps what it
builds in the worker's ``WORKER_STATE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.base import Backend
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.strategy import TorchStrategy
from polytrain.errors import CreatorError
from polytrain.launchers.worker import WORKER_STATE
from polytrain.trainer_api.creators import TorchCreators
from polytrain.trainer_api.data import add_distributed_sampler, set_sampler_epoch
from polytrain.trainer_api.operator import TrainingOperator

_KEY = "torch_trainer"


@dataclass
class WorkerSetup:
    """Everything a worker needs to build its components (sent once per start)."""

    creators: TorchCreators
    operator_cls: type[TrainingOperator]
    backend: Backend
    config: dict[str, Any]
    context: WorkerContext
    scheduler_step_freq: str
    add_dist_sampler: bool
    check_finite_loss: bool


def setup_worker(setup: WorkerSetup, rank_info: Any, device_index: int) -> int:
    """Build this worker's components with the creators and let the backend's strategy prepare them.

    Returns the number of training batches per epoch (-1 when the loader has no length).
    """
    ctx = setup.context.place(rank_info, device_index)
    if not ctx.local_mode:
        torch.set_num_threads(max(1, int(ctx.num_cpus)))
    strategy = setup.backend.make_strategy()
    with strategy.worker_scope(ctx):
        components = _create_components(setup.creators, setup.config, ctx)
        _check_default_step_fits(setup.operator_cls, components)
        components = strategy.setup(components, ctx)
        if setup.add_dist_sampler:
            _add_samplers(components, *strategy.sample_distribution(ctx))
        operator = setup.operator_cls(
            setup.config,
            components,
            setup.backend,
            ctx,
            scheduler_step_freq=setup.scheduler_step_freq,
            check_finite_loss=setup.check_finite_loss,
            strategy=strategy,
        )
        operator.setup(setup.config)
    WORKER_STATE[_KEY] = operator
    return _count_batches(components.train_loader, ctx, setup.config)


def _create_components(
    creators: TorchCreators, config: dict[str, Any], ctx: WorkerContext
) -> Components:
    models = creators.create_models(config)
    train_loader, val_loader = creators.create_data(config)
    for model in models:
        model.to(ctx.device)  # in place: the optimizer creator gets what model_creator returned
    optimizers = creators.create_optimizers(models, config)
    schedulers = creators.create_schedulers(optimizers, config)
    criterion = creators.create_loss(config)
    if isinstance(criterion, torch.nn.Module):
        criterion = criterion.to(ctx.device)
    return Components(
        models=list(models),
        optimizers=list(optimizers),
        criterion=criterion,
        schedulers=list(schedulers),
        train_loader=train_loader,
        val_loader=val_loader,
    )


def _check_default_step_fits(operator_cls: type[TrainingOperator], components: Components) -> None:
    """The default step trains one model with one optimizer: refuse more rather than ignore them."""
    if operator_cls.train_batch is not TrainingOperator.train_batch:
        return
    counts = {
        "model_creator": len(components.models),
        "optimizer_creator": len(components.optimizers),
    }
    for creator, count in counts.items():
        if count > 1:
            raise CreatorError(
                f"{creator} returned {count} objects, and the default training step trains one "
                f"model with one optimizer (it would silently train only the first). Write a "
                f"TrainingOperator subclass whose train_batch uses self.models and "
                f"self.optimizers, and pass it as training_operator_cls (README: Custom steps). "
                f"Several schedulers are fine: the default step steps all of them."
            )


def _add_samplers(components: Components, replicas: int, rank: int) -> None:
    if replicas <= 1:
        return
    components.train_loader = add_distributed_sampler(
        components.train_loader, replicas, rank, training=True
    )
    if components.val_loader is not None:
        components.val_loader = add_distributed_sampler(
            components.val_loader, replicas, rank, training=False
        )


def _count_batches(loader: Any, ctx: WorkerContext, config: dict[str, Any]) -> int:
    try:
        num_batches = len(loader)
    except TypeError:
        return -1
    if num_batches == 0:
        raise ValueError(
            f"The training data loader of rank {ctx.world_rank} has no batches (per-worker "
            f"batch_size={config.get('batch_size')}, dataset size "
            f"{_dataset_len(loader)}, drop_last="
            f"{getattr(loader, 'drop_last', None)}). Give data_creator more data, "
            f"lower batch_size or num_workers, or set drop_last=False."
        )
    return num_batches


def _dataset_len(loader: Any) -> Any:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return "unknown"


def _operator() -> TrainingOperator:
    try:
        return WORKER_STATE[_KEY]
    except KeyError:
        raise RuntimeError(
            "This worker has no trainer set up (setup_worker was not run)."
        ) from None


def train_epoch(
    epoch: int, num_steps: int | None, info: dict[str, Any] | None, capture_state: bool = False
) -> dict[str, Any]:
    """One epoch (or ``num_steps`` batches) of training on this worker.

    With ``capture_state`` every rank takes part in consolidating the training
    state and rank 0 returns it under ``"_state"``: the driver's epoch-end
    checkpoint arrives in the same round trip as the metrics.
    """
    operator = _operator()
    loader = operator.train_loader
    set_sampler_epoch(loader, epoch)
    with operator.strategy.worker_scope(operator.context):
        stats = operator.train_epoch(
            loader, {**(info or {}), "epoch": epoch, "num_steps": num_steps}
        )
    stats.setdefault("epoch", epoch)
    stats["peak_memory_mb"] = peak_memory_mb(operator.device)
    if capture_state:
        state = get_state(epoch + 1)
        if state is not None:
            stats["_state"] = state
    return stats


def validate(num_steps: int | None, info: dict[str, Any] | None) -> dict[str, Any]:
    """Evaluate on this worker's share of the validation data."""
    operator = _operator()
    if operator.val_loader is None:
        raise ValueError(
            "validate() needs validation data: make data_creator return (train_loader, val_loader)."
        )
    with operator.strategy.worker_scope(operator.context):
        return operator.validate(operator.val_loader, {**(info or {}), "num_steps": num_steps})


def get_state(epoch: int) -> dict[str, Any] | None:
    """The consolidated training state (every rank takes part; rank 0 returns it)."""
    operator = _operator()
    strategy: TorchStrategy = operator.strategy
    with strategy.worker_scope(operator.context):
        full = strategy.full_state_dict(operator.components, operator.context)
    if operator.world_rank != 0:
        return None
    components = operator.components
    return {
        "models": full["models"],
        "optimizers": full["optimizers"],
        "schedulers": [s.state_dict() for s in components.schedulers],
        "scaler": components.precision.state_dict() if components.precision else None,
        "operator": operator.state_dict(),
        "global_step": operator.global_step,
    }


def load_state(state: dict[str, Any]) -> None:
    """Load a consolidated training state on this worker."""
    operator = _operator()
    components = operator.components
    strategy: TorchStrategy = operator.strategy
    with strategy.worker_scope(operator.context):
        strategy.load_full_state_dict(components, state, operator.context)
    for scheduler, sched_state in zip(
        components.schedulers, state.get("schedulers") or [], strict=False
    ):
        scheduler.load_state_dict(sched_state)
    if components.precision is not None:
        components.precision.load_state_dict(state.get("scaler"))
    operator.load_state_dict(state.get("operator") or {})
    operator.global_step = int(state.get("global_step", 0))


def apply_to_operator(fn: Any) -> Any:
    """Run ``fn(operator)`` on this worker's operator."""
    operator = _operator()
    with operator.strategy.worker_scope(operator.context):
        return fn(operator)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: resident set size on CPU, allocated memory on GPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def teardown_worker() -> None:
    """Drop this worker's trainer state."""
    WORKER_STATE.pop(_KEY, None)
