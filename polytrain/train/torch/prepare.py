"""``prepare_model``, ``prepare``, ``prepare_data_loader`` and the step helpers of a torch loop.

Each helper hands its work to the backend's worker-side strategy (the one the
creator API uses): ``prepare`` builds a :class:`~polytrain.backends.core.context.Components`
of the model and optimizer and calls ``strategy.setup`` (DDP wrap, Horovod's
``DistributedOptimizer`` and broadcasts, fairscale OSS + ShardedDDP, FSDP2
``fully_shard`` and an optimizer over the sharded parameters, DeepSpeed's engine);
``backward`` / ``step`` / ``zero_grad`` / ``no_sync`` / ``autocast`` call the
strategy on those components, so one loop is right on every backend.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from polytrain.backends.core.context import Components
from polytrain.backends.core.strategy import TorchStrategy
from polytrain.backends.ddp.strategy import DDPStrategy
from polytrain.errors import ConfigError
from polytrain.train import session as train_session
from polytrain.trainer_api.data.loaders import add_distributed_sampler


def get_device() -> torch.device:
    """The torch device this worker computes on (its GPU, or the CPU)."""
    return train_session.current("torch.get_device").worker_context.device


def _session(caller: str) -> train_session.Session:
    return train_session.current(f"torch.{caller}")


def _setup(session: train_session.Session, components: Components, move: bool = True) -> Components:
    ctx = session.worker_context
    for model in components.models if move else ():
        model.to(ctx.device)
    components = session.strategy.setup(components, ctx)
    session.components = components
    return components


def _use_parallelism(session: train_session.Session, parallelism: Any, tp_plan: Any) -> None:
    """Remake the session's strategy for a ``parallelism`` mesh (the backend checks or refuses it)."""
    if parallelism is None and tp_plan is None:
        return
    if session.components is not None:
        raise ConfigError(
            "parallelism= must be given to the first prepare_model / prepare call: the model "
            "layout cannot change after something was prepared. Pass it there."
        )
    backend = copy.copy(session.backend)
    ctx = session.worker_context
    backend.configure_parallelism(parallelism, tp_plan, num_workers=ctx.world_size)
    session.strategy = backend.make_strategy()
    split = session.strategy.sample_distribution(ctx)
    if session.loader_split not in (None, split):
        raise ConfigError(
            f"prepare_data_loader split the data over {session.loader_split[0]} workers before "
            f"parallelism={parallelism} made {split[0]} data-parallel ranks of them: call "
            f"prepare / prepare_model with parallelism= first, then prepare_data_loader."
        )


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
    *,
    parallelism: dict[str, int] | None = None,
    tp_plan: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move ``model`` to the worker's device and wrap it for the backend (DDP, FSDP2, ...).

    For backends that wrap the optimizer too (horovod, deepspeed, fairscale OSS,
    FSDP2's optimizer over sharded parameters) use :func:`prepare`.

    Args:
        model: the module.
        move_to_device: move it to :func:`get_device` (True), to this device, or not.
        parallel_strategy: Ray Train's: ``"ddp"`` (its default) wraps the model the way
            the trainer's backend does (DDP under ``ddp``, FSDP under ``fsdp``, ...);
            ``"fsdp"`` requires ``backend="fsdp"``; None: no wrapper (one process's model
            on every worker: you synchronise gradients yourself).
        parallel_strategy_kwargs: ``DistributedDataParallel`` keyword arguments (``ddp``
            backend only; checked as ``backend_config={"ddp_kwargs": ...}`` is).
        parallelism: a device mesh, as the creator API's ``TorchTrainer(parallelism=)``
            (``{"dp_replicate": R, "dp_shard": S, "tp": T}``; fsdp backend). Call this
            before :func:`prepare_data_loader`, which then splits the data over the
            ``R * S`` data-parallel ranks.
        tp_plan: ``{module name pattern: style}`` for a model without a built-in plan.

    Raises:
        ConfigError: a ``parallel_strategy`` the trainer's backend does not run, or
            keyword arguments for a backend that is not ``ddp``, or a ``parallelism``
            the backend cannot run.
    """
    session = _session("prepare_model")
    _use_parallelism(session, parallelism, tp_plan)
    device = move_to_device if isinstance(move_to_device, torch.device) else None
    if device is not None:
        model.to(device)
    if parallel_strategy is None:
        if move_to_device is True:
            model.to(session.worker_context.device)
        return model
    _check_parallel_strategy(session, parallel_strategy, parallel_strategy_kwargs)
    components = _setup(session, Components(models=[model], optimizers=[]), move_to_device is True)
    prepared = components.model
    if session.options.get("amp"):
        prepared = _AmpForward(prepared, components.precision)
    return prepared


def _check_parallel_strategy(
    session: train_session.Session, parallel_strategy: str, kwargs: dict[str, Any] | None
) -> None:
    name = type(session.strategy).__name__
    if parallel_strategy not in ("ddp", "fsdp"):
        raise ConfigError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) must be 'ddp', 'fsdp' or None."
        )
    if parallel_strategy == "fsdp" and "FSDP" not in name:
        raise ConfigError(
            f"prepare_model(parallel_strategy='fsdp') under the {name} backend: polytrain shards "
            f"with the trainer's backend. Use TorchTrainer(..., backend='fsdp') and keep "
            f"prepare_model(model)."
        )
    if kwargs:
        if not isinstance(session.strategy, DDPStrategy):
            raise ConfigError(
                f"prepare_model(parallel_strategy_kwargs={kwargs!r}) takes DistributedDataParallel "
                f"arguments, for the ddp backend; the {name} backend takes its options as "
                f"backend_config=."
            )
        import dataclasses

        config = session.strategy.config
        merged = dataclasses.replace(config, ddp_kwargs={**config.ddp_kwargs, **kwargs})
        session.strategy = type(session.strategy)(merged)


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_loader: Any = None,
    parallelism: dict[str, int] | None = None,
    tp_plan: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Prepare a model and its optimizer for the backend; returns ``(model, optimizer)``.

    Build the optimizer over ``model.parameters()`` as for one process. The backend
    may replace both (a DeepSpeed engine, a Horovod ``DistributedOptimizer``, an
    OSS optimizer, an optimizer over FSDP2's sharded parameters): train with what
    this returns, through :func:`backward`, :func:`step` and :func:`zero_grad`.

    Args:
        model: the module.
        optimizer: its optimizer.
        data_loader: the prepared training loader, for backends that size their
            batches from it (DeepSpeed's ``train_micro_batch_size_per_gpu``).
        parallelism: a device mesh (see :func:`prepare_model`).
        tp_plan: a tensor-parallel plan (see :func:`prepare_model`).
    """
    session = _session("prepare")
    _use_parallelism(session, parallelism, tp_plan)
    components = _setup(
        session, Components(models=[model], optimizers=[optimizer], train_loader=data_loader)
    )
    return components.model, components.optimizer


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer as the backend trains it, after :func:`prepare_model`.

    Returns it unchanged on ddp (and with no backend) -- or, after
    ``accelerate(amp=True)`` on a GPU, wrapped so that ``step()`` goes through the
    gradient scaler. Backends that wrap the optimizer together with the model need
    :func:`prepare`.

    Raises:
        ConfigError: a backend that wraps model and optimizer together.
    """
    session = _session("prepare_optimizer")
    strategy = session.strategy
    if type(strategy) is TorchStrategy or isinstance(strategy, DDPStrategy):
        if session.components is not None:
            session.components.optimizers = [optimizer]
            precision = session.components.precision
            if getattr(precision, "scaler", None) is not None:
                return _AmpOptimizer(optimizer, precision)
        return optimizer
    raise ConfigError(
        f"prepare_optimizer: the {type(strategy).__name__} backend wraps the model and its "
        f"optimizer together. Build the optimizer over the unprepared model and call "
        f"model, optimizer = polytrain.train.torch.prepare(model, optimizer) instead."
    )


def prepare_data_loader(
    data_loader: torch.utils.data.DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
) -> Any:
    """``data_loader`` with a ``DistributedSampler`` for this worker's share, batches on its device."""
    session = _session("prepare_data_loader")
    seed = session.options.get("seed")
    if seed is not None:  # enable_reproducibility(): seeded shuffling and loader workers
        generator = torch.Generator()
        generator.manual_seed(seed)
        data_loader.generator = generator
        if data_loader.worker_init_fn is None:
            data_loader.worker_init_fn = _seed_worker
    if add_dist_sampler:
        replicas, rank = session.strategy.sample_distribution(session.worker_context)
        session.loader_split = (replicas, rank)
        if replicas > 1:
            data_loader = add_distributed_sampler(data_loader, replicas, rank, training=True)
    device = session.worker_context.device
    if move_to_device and device.type != "cpu":
        return _DeviceLoader(data_loader, device)
    return data_loader


class _DeviceLoader:
    """A loader whose batches (tensors, or tuples / lists / dicts of them) are on ``device``."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Any:
        for batch in self.loader:
            yield _to(batch, self.device)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


# ------------------------------------------------------------------ step helpers
def _components(caller: str) -> tuple[Any, Components]:
    session = _session(caller)
    components = session.components
    if components is None:  # nothing prepared: a plain loop (local tests, one worker)
        components = session.components = Components(models=[], optimizers=[])
    return session.strategy, components


def backward(loss: torch.Tensor) -> None:
    """Back-propagate ``loss`` as the backend does (DeepSpeed's engine, a GradScaler, ...)."""
    strategy, components = _components("backward")
    strategy.backward(loss, components)


def step() -> None:
    """Apply the gradients with the prepared optimizer (``engine.step()`` on DeepSpeed)."""
    strategy, components = _components("step")
    strategy.step(components)


def zero_grad() -> None:
    """Clear the gradients as the backend needs it (in place on fairscale ShardedDDP, ...)."""
    strategy, components = _components("zero_grad")
    strategy.zero_grad(components)


def no_sync() -> contextlib.AbstractContextManager:
    """A context whose backward passes accumulate without synchronising gradients."""
    strategy, components = _components("no_sync")
    return strategy.no_sync(components)


def autocast() -> contextlib.AbstractContextManager:
    """The backend's mixed-precision context for a forward pass (a no-op without ``use_fp16``)."""
    strategy, components = _components("autocast")
    return strategy.autocast(components)


def clip_grad_norm_(max_norm: float) -> torch.Tensor | None:
    """Clip the prepared model's global gradient norm to ``max_norm``, the backend's way.

    Call it after :func:`backward` and before :func:`step`. The strategy clips
    where gradients are whole: torch's ``clip_grad_norm_`` on ddp and FSDP2, after
    Horovod's ``synchronize()`` (the next :func:`step` skips its own), through
    ``OSS.clip_grad_norm`` on fairscale, FSDP1's ``model.clip_grad_norm_``.

    Returns:
        The norm before clipping; None on deepspeed, whose engine clips inside its
        step to its ``gradient_clipping`` config (``max_norm`` must equal it).
    """
    strategy, components = _components("clip_grad_norm_")
    return strategy.clip_grad_norm_(components, max_norm)


def full_state_dict() -> dict[str, Any] | None:
    """The prepared model's and optimizer's consolidated state, backend-independent (collective).

    Call it on every rank at once (sharded backends gather here). Rank 0 gets
    ``{"models": [model_state_dict], "optimizers": [torch-format state]}``, the
    form the creator API saves: it loads under any backend and world size
    (``model.load_state_dict(state["models"][0])``, or a creator trainer's
    ``load_state_dict``). Other ranks get None.
    """
    session = _session("full_state_dict")
    if session.components is None:
        raise ConfigError(
            "full_state_dict() needs a prepared model: call prepare_model(model) or "
            "prepare(model, optimizer) first."
        )
    return session.strategy.full_state_dict(session.components, session.worker_context)


# ------------------------------------------------------------------ Ray Train's extras
def get_devices() -> list[torch.device]:
    """Every torch device of this worker: its GPUs in ``torch.device("cuda", i)`` form, or the CPU.

    The first is :func:`get_device`. A worker with several GPUs
    (``ScalingConfig(num_gpus_per_worker=2)``) gets them all, as Ray Train's
    ``get_devices()`` gives them: the indices of Ray's GPU ids among the visible devices.
    """
    device = get_device()
    if device.type != "cuda":
        return [device]
    import os

    try:
        import ray

        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - outside Ray (local mode): the one device
        return [device]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    order = [v.strip() for v in visible.split(",") if v.strip()]
    indices = [order.index(g) for g in gpu_ids if g in order] if order else []
    if not indices:
        return [device]
    first = [i for i in indices if i == device.index] or indices[:1]
    return [torch.device("cuda", i) for i in first + [i for i in indices if i not in first]]


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, Python and NumPy, and make torch deterministic (Ray Train's helper).

    Also seeds the DataLoader workers of loaders prepared afterwards with
    :func:`prepare_data_loader` (a seeded generator and ``worker_init_fn``). Call it at the
    top of the loop, before building the model. The deterministic mode ends with the loop
    (a warm worker runs the next trainer as it was before).
    """
    import os
    import random

    import numpy as np

    session = _session("enable_reproducibility")
    # Warm-pool workers outlive the run: the loop's end puts the previous modes back.
    deterministic = torch.are_deterministic_algorithms_enabled()
    benchmark = torch.backends.cudnn.benchmark
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")

    def restore() -> None:
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace

    session.options.setdefault("on_loop_end", []).append(restore)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # Deterministic cuBLAS needs this (torch raises without it on CUDA).
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    session.options["seed"] = seed


def _seed_worker(worker_id: int) -> None:
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def accelerate(amp: bool = False) -> None:
    """Turn on automatic mixed precision for what is prepared next (Ray Train 1.x's ``accelerate``).

    With ``amp=True``: the model :func:`prepare_model` returns runs its forward under
    the backend's autocast (fp16 with a gradient scaler on GPU, bf16 on CPU), and
    :func:`backward` / the optimizer :func:`prepare_optimizer` returns scale and
    unscale the gradients. The same as the trainer's ``use_fp16=True``, chosen in the loop.

    Raises:
        ConfigError: called twice, or after the model was prepared.
    """
    session = _session("accelerate")
    if session.options.get("accelerated"):
        raise ConfigError("accelerate() was already called in this loop; call it once.")
    if session.components is not None and session.components.models:
        raise ConfigError("accelerate() must be called before prepare_model() / prepare().")
    session.options["accelerated"] = True
    if amp:
        session.worker_context.use_fp16 = True
        session.options["amp"] = True


class _AmpForward(torch.nn.Module):
    """Runs the wrapped module's forward under the backend's autocast (``accelerate(amp=True)``)."""

    _polytrain_wrapper = True  # TorchCheckpoint.from_model saves what it wraps

    def __init__(self, module: torch.nn.Module, precision: Any) -> None:
        super().__init__()
        self.module = module
        self._precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._precision.autocast():
            return self.module(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The precision (its scaler, CUDA state) stays behind: a pickled model is plain.
        state = self.__dict__.copy()
        state["_precision"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from polytrain.backends.core.precision import Precision

        self.__dict__.update(state)
        if self._precision is None:
            self._precision = Precision()


class _AmpOptimizer:
    """An optimizer whose ``step()`` goes through the gradient scaler (``accelerate(amp=True)`` on GPU)."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any) -> None:
        self.optimizer = optimizer
        self._precision = precision

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ConfigError(
                "An optimizer step with a closure cannot go through the AMP gradient scaler; "
                "call step() without one."
            )
        self._precision.step([self.optimizer])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
