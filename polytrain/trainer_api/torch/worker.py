"""Entry points the TorchTrainer runs inside every worker (through the worker group).

Each function is module-level (so it pickles by reference) and keeps what it
builds in the worker's ``WORKER_STATE``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.blocks import apply_activation_checkpointing
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.local_state import load_local_state
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.checkpoint import rng_state
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import SaveRequest
from polytrain.checkpoint.pieces import FROZEN_KEY, StateReader
from polytrain.checkpoint.safetensors_export import META_KEY
from polytrain.compat.allocator import release_free_memory
from polytrain.errors import CreatorError
from polytrain.hf import adapters
from polytrain.launchers.worker import WORKER_STATE
from polytrain.trainer_api.creators import TorchCreators
from polytrain.trainer_api.data.cursor import DataCursor
from polytrain.trainer_api.data.loaders import add_distributed_sampler
from polytrain.trainer_api.profiling import PhaseTimer
from polytrain.trainer_api.torch import checkpoint as checkpoint_torch
from polytrain.trainer_api.torch import frozen, stopping
from polytrain.trainer_api.torch.operator import TrainingOperator, overrides

_KEY = "torch_trainer"
_CURSOR = "torch_trainer_cursor"


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
        components = _create_components(setup.creators, setup.config, ctx, strategy)
        components = strategy.setup(components, ctx)
        if ctx.step.compile and not getattr(strategy, "compiles_in_prepare", False):
            _compile(components)
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
        _check_default_step_fits(operator)
    WORKER_STATE[_KEY] = operator
    WORKER_STATE[_CURSOR] = DataCursor(operator.train_loader)
    stopping.gate()  # answers the driver's stop requests from now on, even before a call
    # The set-up freed about as much as it keeps (full builds partitioned or broadcast):
    # give it back rather than carry it into training as resident memory.
    release_free_memory()
    return _count_batches(components.train_loader, ctx, setup.config)


def _create_components(
    creators: TorchCreators, config: dict[str, Any], ctx: WorkerContext, strategy: TorchStrategy
) -> Components:
    # The backend places the models (sharded ones: built in full on rank 0 only).
    models = strategy.build_models(lambda: creators.create_models(config), ctx)
    release_free_memory()  # rank 0's full copy, zero.Init's per-module full builds
    for model in models:
        adapters.check_quantized(model, ctx.device.type)  # QLoRA: refused on CPU workers
    train_loader, val_loader = creators.create_data(config)
    # Before the backend wraps: fully_shard / DeepSpeed then wrap checkpointed blocks. A
    # mesh strategy applies it itself, after its tensor-parallel plan (torchtitan's order).
    for model in () if getattr(strategy, "applies_activation_checkpointing", False) else models:
        apply_activation_checkpointing(model, ctx.step.activation_checkpointing)
    # Frozen parameters (a LoRA base) stay out of the optimizers, before schedulers bind them.
    optimizers = frozen.trainable_optimizers(creators.create_optimizers(models, config), models)
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


def _compile(components: Components) -> None:
    """``torch.compile`` every trained model in place, after the backend wrapped it.

    In place (``Module.compile``) keeps parameter names and state dicts; compiling the
    DDP wrapper lets Dynamo split graphs at DDP's buckets (torch's DDPOptimizer), and
    under FSDP2 it comes after ``fully_shard``, as torch's FSDP2 docs order it.
    """
    for model in components.models:
        if any(p.requires_grad for p in model.parameters()):
            model.compile()


def _check_default_step_fits(operator: TrainingOperator) -> None:
    """Refuse several models or optimizers when only the defaults would train them.

    The default ``train_epoch`` calling the default ``train_batch`` trains the first
    model with the first optimizer. An operator that overrides either one (on its
    class, or on the instance in ``setup`` as RaySGD's tests do) drives the models
    itself; should its own ``train_epoch`` still call the default ``train_batch``,
    that step refuses then (see :meth:`TrainingOperator.train_batch`).
    """
    if overrides(operator, "train_batch") or overrides(operator, "train_epoch"):
        return
    operator.check_single_model()


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
        raise CreatorError(
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


@dataclass
class StateCapture:
    """How the training state leaves the workers when a call ends an epoch.

    Attributes:
        envelope: the checkpoint envelope (format, version, framework, ...) rank 0
            completes with the epoch and writes around the state.
        path: where rank 0 writes the checkpoint file, if the file's directory
            exists on rank 0's node (the driver created it there: the same node);
            None, or a directory rank 0 does not see: rank 0 returns the state
            itself, through the driver.
    """

    envelope: dict[str, Any]
    path: str | None = None


@dataclass
class TrainCall:
    """One ``train()`` call as every worker receives it.

    Attributes:
        epoch: the epoch the driver is in.
        position: batches of ``epoch`` already trained (where this call starts).
        num_steps: at most this many batches; None: the rest of the epoch.
        info: the user's ``train(info=...)`` dict.
        profile: time the phases of the loop.
        capture: take the state at the end of the epoch, if this call ends it.
        end_epoch: end the epoch after this call even if the loader is not exhausted.
        capture_mid: a mid-epoch checkpoint directory to write if this call stops
            inside the epoch at the position the driver expects (``extra["epoch_step"]``).
        call_id: the driver's number for the call, which its requests to stop early name
            (:mod:`polytrain.trainer_api.torch.stopping`); None: it will not ask.
    """

    epoch: int
    position: int = 0
    num_steps: int | None = None
    info: dict[str, Any] | None = None
    profile: bool = False
    capture: StateCapture | SaveRequest | None = None
    end_epoch: bool = False
    capture_mid: SaveRequest | None = None
    call_id: int | None = None


def _count_once(stats: dict[str, Any], operator: TrainingOperator) -> None:
    """Samples several ranks compute on together (a tensor-parallel group) count once.

    The group's first rank reports them; the others report none, so the driver's sums
    (``num_samples``, ``num_tokens``) are the data's and its sample-weighted means skip them.
    """
    counts = getattr(operator.strategy, "counts_samples", None)
    if callable(counts) and not counts(operator.context):
        for key in ("num_samples", "num_tokens"):
            if key in stats:
                stats[key] = 0


def _seek(operator: TrainingOperator, cursor: DataCursor, call: TrainCall) -> None:
    """Move the cursor to the call's position; restore a loaded checkpoint's random states.

    They are restored where the saving run stood: at an epoch start the new iterator
    draws from them (as it did then); mid-epoch the saving run's iterator existed
    already, so they apply after the re-created one has skipped ahead.
    """
    saved_rng = getattr(operator, "_pending_rng_state", None)
    operator._pending_rng_state = None
    if saved_rng is not None and call.position == 0:
        rng_state.restore(saved_rng)
    cursor.seek(call.epoch, call.position)
    if saved_rng is not None and call.position > 0:
        rng_state.restore(saved_rng)


def train_epoch(call: TrainCall) -> dict[str, Any]:
    """Train ``call.num_steps`` batches (or the rest of the epoch) on this worker.

    The batches continue the epoch where the previous call stopped (see
    :class:`~polytrain.trainer_api.data.cursor.DataCursor`). The result carries the
    operator's metrics, ``epoch``, and under ``"_cursor"`` the position reached and
    whether the epoch ended. An epoch that ended with ``call.capture`` set has
    every rank take part in consolidating the state; rank 0 writes it to
    ``capture.path`` (returning ``"_state_path"``) or returns it (``"_state"``).
    """
    operator = _operator()
    cursor: DataCursor = WORKER_STATE[_CURSOR]
    if cursor.loader is not operator.train_loader:  # the user replaced the loader
        cursor = WORKER_STATE[_CURSOR] = DataCursor(operator.train_loader)
    _seek(operator, cursor, call)
    if cursor.position > 0 and cursor.finish_call():
        cursor.seek(call.epoch + 1, 0)  # a position at an epoch's very end: the next one starts
    epoch, first = cursor.epoch, cursor.position
    operator.timer = PhaseTimer(call.profile, operator.device)
    info = {
        **(call.info or {}),
        "epoch": epoch,
        "epoch_idx": epoch,
        "num_steps": call.num_steps,
        "first_batch_idx": first,
    }
    start = time.perf_counter()
    with operator.strategy.worker_scope(operator.context):
        # num_steps counts optimizer steps, each of gradient_accumulation_steps batches.
        k = operator.context.step.gradient_accumulation_steps
        batches = call.num_steps * k if call.num_steps is not None else None
        iterator = cursor.take(batches, operator.timer, call.end_epoch)
        if call.call_id is not None:  # the driver may stop the call at an agreed batch
            iterator = stopping.GatedSteps(iterator, stopping.gate())
            iterator.gate.begin(call.call_id)
        try:
            stats = operator.train_call(iterator, info)
        finally:
            if call.call_id is not None:
                iterator.gate.end()
    elapsed = time.perf_counter() - start
    untouched = cursor.position == first and not cursor.exhausted
    # Untouched: the operator iterated the loader itself, not the iterator it was
    # given, so the call was a whole epoch. Either way the next epoch starts afresh.
    done = untouched or iterator.ends_epoch()
    if done:
        cursor.reset()
    stats.setdefault("epoch", epoch)
    _count_once(stats, operator)
    stats["peak_memory_mb"] = peak_memory_mb(operator.device)
    stats["_cursor"] = {"epoch": epoch, "position": cursor.position, "epoch_done": done}
    if call.profile:
        stats["profile"] = operator.timer.report(elapsed)
    operator.timer = PhaseTimer()
    if done and call.capture is not None:
        _capture(stats, call.capture, epoch + 1)
    elif not done and call.capture_mid is not None:
        _capture_mid(stats, call.capture_mid, cursor.position)
    return stats


def _capture_mid(stats: dict[str, Any], request: SaveRequest, position: int) -> None:
    """Write a mid-epoch checkpoint directory; the data position goes into its meta.

    Every rank stops at the same position (the loop runs in lockstep), so all of
    them write or none does: a call that stopped elsewhere than planned (a custom
    ``train_epoch`` that returned early) writes nothing rather than a misnamed one.
    """
    if request.extra.get("epoch_step") != position:
        return
    start = time.perf_counter()
    stats["_checkpoint"] = checkpoint_torch.save_operator(_operator(), request)
    if "profile" in stats:
        stats["profile"]["capture_s"] = time.perf_counter() - start


def _capture(stats: dict[str, Any], capture: StateCapture | SaveRequest, next_epoch: int) -> None:
    start = time.perf_counter()
    if isinstance(capture, SaveRequest):
        # Every rank writes its own part of a checkpoint directory; the driver gets the path.
        request = dataclasses.replace(capture, header={**capture.header, "epoch": next_epoch})
        stats["_checkpoint"] = checkpoint_torch.save_operator(_operator(), request)
        state = None
    else:
        state = get_state(next_epoch)  # every rank takes part; rank 0 gets the state
    if state is not None:
        if capture.path is not None and os.path.isdir(os.path.dirname(capture.path)):
            ckpt.save_checkpoint(
                {**capture.envelope, "epoch": next_epoch, "epoch_step": 0, **state}, capture.path
            )
            stats["_state_path"] = capture.path
        else:
            stats["_state"] = state
    if "profile" in stats:
        stats["profile"]["capture_s"] = time.perf_counter() - start


def validate(
    num_steps: int | None, info: dict[str, Any] | None, profile: bool = False
) -> dict[str, Any]:
    """Evaluate ``num_steps`` batches (None: all) of this worker's share of the validation data."""
    operator = _operator()
    if operator.val_loader is None:
        raise CreatorError(
            "validate() needs validation data: make data_creator return (train_loader, val_loader)."
        )
    operator.timer = PhaseTimer(profile, operator.device)
    start = time.perf_counter()
    with operator.strategy.worker_scope(operator.context):
        stats = operator.validate(operator.val_loader, {**(info or {}), "num_steps": num_steps})
    _count_once(stats, operator)
    if profile:
        stats["profile"] = operator.timer.report(time.perf_counter() - start)
    operator.timer = PhaseTimer()
    return stats


def update_scheduler(metric: Any) -> None:
    """``scheduler.step(metric)`` for every scheduler on this worker (e.g. ReduceLROnPlateau)."""
    for scheduler in _operator().schedulers:
        scheduler.step(metric)


def get_state(epoch: int) -> dict[str, Any] | None:
    """The consolidated training state (every rank takes part; rank 0 returns it)."""
    operator = _operator()
    strategy: TorchStrategy = operator.strategy
    with strategy.worker_scope(operator.context):
        full = strategy.full_state_dict(operator.components, operator.context)
    entries = frozen.frozen_entries(operator)
    if operator.world_rank != 0:
        return None
    state = {"models": full["models"], "optimizers": full["optimizers"]}
    return {
        **frozen.drop_frozen(state, entries),  # a LoRA run's state: the adapters, not the base
        **checkpoint_torch.trainer_state(operator),
        META_KEY: checkpoint_torch.export_infos(operator),
    }


def load_state(state: dict[str, Any]) -> None:
    """Load a consolidated training state on this worker."""
    operator = _operator()
    components = operator.components
    strategy: TorchStrategy = operator.strategy
    with strategy.worker_scope(operator.context):
        if any(state.get(FROZEN_KEY) or []):
            # Frozen parameters left out: each rank reads what it holds, keeps the rest.
            frozen.check_loadable(state, operator)
            load_local_state(strategy, components, StateReader(state), operator.context)
        else:
            strategy.load_full_state_dict(components, state, operator.context)
    checkpoint_torch.load_trainer_state(operator, state)


def load_state_file(path: str) -> None:
    """Read a checkpoint file rank 0 wrote (on this node) and load it on this worker."""
    load_state(ckpt.load_checkpoint(path, framework="torch"))


def sees_file(path: str) -> bool:
    """Whether ``path`` is a file on this worker's node."""
    return os.path.isfile(path)


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
    WORKER_STATE.pop(_CURSOR, None)


def load_dir(url: str) -> dict[str, Any]:
    """Worker entry point (``trainer._run(load_dir, url)``): load a checkpoint directory into this worker's operator."""
    return apply_to_operator(functools.partial(checkpoint_torch.load_operator, url=url))


def save_dir(request: SaveRequest) -> dict[str, Any]:
    """Worker entry point (``trainer._run(save_dir, request)``): write this worker's part of a checkpoint directory now."""
    return apply_to_operator(functools.partial(checkpoint_torch.save_operator, request=request))


def retune_optimizers(
    creators: TorchCreators, old: dict[str, Any], operator: TrainingOperator
) -> None:
    """Worker: the hyperparameters the config's changed keys alter, set on the live optimizers."""
    models = tuple(operator.strategy.unwrap_model(m) for m in operator.models)
    before = creators.create_optimizers(models, {**operator.config, **old})
    after = creators.create_optimizers(models, dict(operator.config))
    for live, was, new in zip(operator.optimizers, before, after, strict=False):
        for group, was_group, new_group in zip(
            live.param_groups, was.param_groups, new.param_groups, strict=False
        ):
            for key, value in new_group.items():
                if key == "params" or _same(was_group.get(key), value):
                    continue
                if key == "lr" and was_group.get("lr"):
                    group["lr"] = group["lr"] * value / was_group["lr"]
                    if "initial_lr" in group:
                        group["initial_lr"] = value
                else:
                    group[key] = value
    for scheduler in operator.schedulers:
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", [])
        if hasattr(scheduler, "base_lrs") and all("initial_lr" in g for g in groups):
            scheduler.base_lrs = [g["initial_lr"] for g in groups]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, RuntimeError, ValueError):  # e.g. tensors of several elements
        return a is b
