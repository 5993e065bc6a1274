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
    move_to_device: bool = True,
    *,
    parallelism: dict[str, int] | None = None,
    tp_plan: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move ``model`` to the worker's device and wrap it for the backend (DDP, FSDP2, ...).

    For backends that wrap the optimizer too (horovod, deepspeed, fairscale OSS,
    FSDP2's optimizer over sharded parameters) use :func:`prepare`.

    Args:
        model: the module.
        move_to_device: move it to the worker's device first.
        parallelism: a device mesh, as the creator API's ``TorchTrainer(parallelism=)``
            (``{"dp_replicate": R, "dp_shard": S, "tp": T}``; fsdp backend). Call this
            before :func:`prepare_data_loader`, which then splits the data over the
            ``R * S`` data-parallel ranks.
        tp_plan: ``{module name pattern: style}`` for a model without a built-in plan.
    """
    session = _session("prepare_model")
    _use_parallelism(session, parallelism, tp_plan)
    return _setup(session, Components(models=[model], optimizers=[]), move_to_device).model


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

    Returns it unchanged on ddp (and with no backend); backends that wrap the
    optimizer together with the model need :func:`prepare`.

    Raises:
        ConfigError: a backend that wraps model and optimizer together.
    """
    session = _session("prepare_optimizer")
    strategy = session.strategy
    if type(strategy) is TorchStrategy or isinstance(strategy, DDPStrategy):
        if session.components is not None:
            session.components.optimizers = [optimizer]
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
