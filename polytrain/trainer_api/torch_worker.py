"""Entry points the TorchTrainer runs inside every worker (through the worker group).

Each function is module-level (so it pickles by reference) and keeps what it
builds in the worker's ``WORKER_STATE``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.base import Backend, Components, WorkerContext
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


def _device_for(ctx: WorkerContext, device_index: int) -> torch.device:
    if ctx.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"use_gpu=True but worker rank {ctx.world_rank} sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})."
            )
        return torch.device("cuda", max(device_index, 0))
    return torch.device("cpu")


def setup_worker(setup: WorkerSetup, rank_info: Any, device_index: int) -> int:
    """Build this worker's components with the creators and let the backend prepare them."""
    ctx = setup.context.for_rank(rank_info)
    ctx.device = _device_for(ctx, device_index)
    if not ctx.local_mode:
        torch.set_num_threads(max(1, int(ctx.num_cpus)))
    backend = setup.backend
    creators = setup.creators
    config = setup.config
    with backend.worker_scope(ctx):
        models = creators.create_models(config)
        train_loader, val_loader = creators.create_data(config)
        models = tuple(m.to(ctx.device) for m in models)
        optimizers = creators.create_optimizers(models, config)
        schedulers = creators.create_schedulers(optimizers, config)
        criterion = creators.create_loss(config)
        if isinstance(criterion, torch.nn.Module):
            criterion = criterion.to(ctx.device)
        components = Components(
            models=list(models),
            optimizers=list(optimizers),
            criterion=criterion,
            schedulers=list(schedulers),
            train_loader=train_loader,
            val_loader=val_loader,
        )
        components.scaler = backend.make_scaler(ctx)
        components = backend.prepare(components, ctx)
        if setup.add_dist_sampler:
            replicas, rank = backend.sample_distribution(ctx)
            if replicas > 1:
                components.train_loader = add_distributed_sampler(
                    components.train_loader, replicas, rank, training=True
                )
                if components.val_loader is not None:
                    components.val_loader = add_distributed_sampler(
                        components.val_loader, replicas, rank, training=False
                    )
        operator = setup.operator_cls(
            config,
            components,
            backend,
            ctx,
            scheduler_step_freq=setup.scheduler_step_freq,
            check_finite_loss=setup.check_finite_loss,
        )
        operator.setup(config)
    WORKER_STATE[_KEY] = operator
    try:
        num_batches = len(components.train_loader)
    except TypeError:
        return -1
    if num_batches == 0:
        raise ValueError(
            f"The training data loader of rank {ctx.world_rank} has no batches (per-worker "
            f"batch_size={config.get('batch_size')}, dataset size "
            f"{_dataset_len(components.train_loader)}, drop_last="
            f"{getattr(components.train_loader, 'drop_last', None)}). Give data_creator more data, "
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
    with operator.backend.worker_scope(operator.context):
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
    with operator.backend.worker_scope(operator.context):
        return operator.validate(operator.val_loader, {**(info or {}), "num_steps": num_steps})


def get_state(epoch: int) -> dict[str, Any] | None:
    """The consolidated training state (every rank takes part; rank 0 returns it)."""
    operator = _operator()
    with operator.backend.worker_scope(operator.context):
        full = operator.backend.full_state_dict(operator.components, operator.context)
    if operator.world_rank != 0:
        return None
    components = operator.components
    return {
        "models": full["models"],
        "optimizers": full["optimizers"],
        "schedulers": [s.state_dict() for s in components.schedulers],
        "scaler": components.scaler.state_dict() if components.scaler is not None else None,
        "operator": operator.state_dict(),
        "global_step": operator.global_step,
    }


def load_state(state: dict[str, Any]) -> None:
    """Load a consolidated training state on this worker."""
    operator = _operator()
    components = operator.components
    with operator.backend.worker_scope(operator.context):
        operator.backend.load_full_state_dict(components, state, operator.context)
    for scheduler, sched_state in zip(
        components.schedulers, state.get("schedulers") or [], strict=False
    ):
        scheduler.load_state_dict(sched_state)
    if components.scaler is not None and state.get("scaler"):
        components.scaler.load_state_dict(state["scaler"])
    operator.load_state_dict(state.get("operator") or {})
    operator.global_step = int(state.get("global_step", 0))


def apply_to_operator(fn: Any) -> Any:
    """Run ``fn(operator)`` on this worker's operator."""
    operator = _operator()
    with operator.backend.worker_scope(operator.context):
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
