"""The worker side of the horovod backend: ``hvd.DistributedOptimizer`` and rank-0 broadcasts.

Models stay unwrapped (Horovod hooks the optimizer), so checkpoints are plain
torch state dicts that load under any backend. Gradient accumulation
(``backward_passes_per_step``) and ``no_sync`` hold Horovod's allreduce back for
the passes of one window; the precision plugin is the default one (fp16 with a
GradScaler on GPU, bf16 autocast on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import TorchStrategy, stepped

if TYPE_CHECKING:
    from polytrain.backends.horovod.config import HorovodConfig

# Backward passes since the last optimizer step, kept with the components they count.
_ACCUM_KEY = "horovod_backward_passes"
# The optimizers (ids) whose allreduce clipping already waited for: their step must not wait again.
_SYNCED_KEY = "horovod_synchronized"


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


class HorovodStrategy(TorchStrategy):
    """Worker side of ``horovod``: every optimizer wrapped in ``hvd.DistributedOptimizer``.

    On GPU, Horovod's CUDA path (NCCL) reduces the gradients when Horovod was
    built with it; otherwise they are staged through host memory and reduced
    with gloo.

    Args:
        config: the backend's :class:`~polytrain.backends.horovod.config.HorovodConfig`.
        force_host_staging: stage GPU tensors through host memory even if Horovod
            can handle CUDA tensors (tests run that path on CPU).
    """

    config: HorovodConfig

    def __init__(self, config: HorovodConfig, force_host_staging: bool = False) -> None:
        super().__init__(config)
        self.force_host_staging = force_host_staging

    # ------------------------------------------------------------ preparation
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap every optimizer in ``hvd.DistributedOptimizer``; broadcast rank 0's state.

        Raises:
            RuntimeError: Horovod is not initialised (the rendezvous did not run).
        """
        hvd = _hvd()
        if not hvd.is_initialized():
            raise RuntimeError(
                "Horovod is not initialised in this worker: the horovod backend's rendezvous "
                "(HorovodRendezvous.on_start) must run in the driver before prepare (use the "
                "backend through TorchTrainer)."
            )
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[self.config.op]
        compression = self._compression(hvd, ctx)
        originals = components.optimizers
        components.optimizers = [
            hvd.DistributedOptimizer(
                optimizer,
                named_parameters=_named_parameters(components.models, optimizer, index),
                compression=compression,
                backward_passes_per_step=self.config.backward_passes_per_step,
                op=op,
            )
            for index, optimizer in enumerate(originals)
        ]
        _retarget_schedulers(components.schedulers, originals, components.optimizers)
        components.extra[_ACCUM_KEY] = 0
        self._broadcast_from_rank0(components, ctx)
        return components

    def _compression(self, hvd: Any, ctx: WorkerContext) -> Any:
        compression = hvd.Compression.fp16 if self.config.compression == "fp16" else None
        compression = compression or hvd.Compression.none
        if self._host_staging(hvd, ctx):
            return _HostStaging(compression)
        return compression

    def _host_staging(self, hvd: Any, ctx: WorkerContext) -> bool:
        return self.force_host_staging or (
            ctx.device.type == "cuda" and not _reduces_cuda_tensors(hvd)
        )

    def _broadcast_from_rank0(self, components: Components, ctx: WorkerContext) -> None:
        hvd = _hvd()
        if hvd.size() == 1:
            return
        staging = self._host_staging(hvd, ctx)
        for index, model in enumerate(components.models):
            _broadcast_model(hvd, model, index, staging)
        for index, optimizer in enumerate(components.optimizers):
            _broadcast_optimizer(hvd, optimizer, index, staging)

    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: Horovod's ``(size, rank)``."""
        hvd = _hvd()
        return hvd.size(), hvd.rank()

    # ------------------------------------------------------------------- step
    def _accumulating(self, components: Components) -> bool:
        """True between the backward passes of one accumulation window."""
        k = self.config.backward_passes_per_step
        return k > 1 and components.extra.get(_ACCUM_KEY, 0) % k != 0

    def zero_grad(self, components: Components) -> None:
        """Worker: plain ``zero_grad()`` (Horovod's optimizer rejects ``set_to_none``).

        Skipped inside an accumulation window (``backward_passes_per_step > 1``).
        """
        if self._accumulating(components):
            return
        for optimizer in components.optimizers:
            optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: back-propagate; Horovod's hooks start the allreduce of ready gradients."""
        super().backward(loss, components)
        components.extra[_ACCUM_KEY] = components.extra.get(_ACCUM_KEY, 0) + 1

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: wait for the allreduce and apply the gradients.

        With a GradScaler the gradients are synchronised first, so the scaler
        unscales and checks the reduced gradients. Inside an accumulation window
        this does nothing.
        """
        if self._accumulating(components):
            return
        scaler = components.scaler
        waited = components.extra.setdefault(_SYNCED_KEY, set())
        for optimizer in stepped(components, optimizer_index):
            synced = id(optimizer) in waited
            waited.discard(id(optimizer))
            if scaler is not None:
                if not synced:
                    optimizer.synchronize()
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
            elif synced:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        if scaler is not None:
            scaler.update()

    def clip_grad_norm_(
        self, components: Components, max_norm: float, optimizer_index: int | None = None
    ) -> torch.Tensor | None:
        """Worker: wait for the allreduce, unscale, then clip the averaged gradients.

        Clipping before ``synchronize()`` would measure each rank's own, unreduced
        gradients (the allreduce completes inside ``step()``); the next :meth:`step`
        then skips its own synchronisation. Every optimizer's gradients, or with
        ``optimizer_index`` that optimizer's.
        """
        optimizers = stepped(components, optimizer_index)
        for optimizer in optimizers:
            optimizer.synchronize()
        components.extra.setdefault(_SYNCED_KEY, set()).update(id(o) for o in optimizers)
        if components.precision is not None:
            components.precision.unscale_(optimizers)
        params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    @contextlib.contextmanager
    def no_sync(self, components: Components) -> Iterator[None]:
        """Worker: backward passes inside accumulate locally and start no allreduce.

        Horovod counts backward passes per parameter and reduces on the last of
        ``backward_passes_per_step``; here the count is held back for the passes
        inside the context, as DDP's ``no_sync`` does.
        """
        saved = []
        for optimizer in components.optimizers:
            delays = getattr(optimizer, "_allreduce_delay", None)
            if delays is None:
                continue
            saved.append((optimizer, dict(delays)))
            for param in delays:
                delays[param] += 1 << 30
        try:
            yield
        finally:
            for optimizer, delays in saved:
                optimizer._allreduce_delay.update(delays)
                # A hook that ran inside the context left a (None, None) handle; the
                # next backward pass or synchronize() replaces it.

    # ------------------------------------------------------------------ state
    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load the state on every rank, then broadcast rank 0's copy again."""
        super().load_full_state_dict(components, state, ctx)
        components.extra[_ACCUM_KEY] = 0
        self._broadcast_from_rank0(components, ctx)


# --------------------------------------------------------------------- helpers
class _HostStaging:
    """A Horovod compression that stages GPU tensors through host memory.

    For a Horovod built without CUDA support: tensors are (optionally compressed,)
    copied to the CPU for gloo, and copied back to their device afterwards.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compressed, ctx = self.inner.compress(tensor)
        return compressed.cpu(), (ctx, tensor.device)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        inner_ctx, device = ctx
        return self.inner.decompress(tensor.to(device), inner_ctx)


def _named_parameters(
    models: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, index: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """Unique, rank-independent names for every parameter of ``optimizer``.

    Horovod matches tensors across ranks by name. Parameters of the models get
    their module path (prefixed with the model index, so two models never clash);
    parameters that belong to no model get their position in the optimizer.
    """
    names: dict[int, str] = {}
    for m, model in enumerate(models):
        for name, param in model.named_parameters():
            names.setdefault(id(param), f"model{m}.{name}")
    named = []
    for g, group in enumerate(optimizer.param_groups):
        for p, param in enumerate(group["params"]):
            named.append((names.get(id(param), f"optimizer{index}.group{g}.param{p}"), param))
    return named


def _retarget_schedulers(
    schedulers: Sequence[Any], originals: Sequence[Any], wrapped: Sequence[Any]
) -> None:
    """Point LR schedulers built on the user's optimizers at Horovod's wrappers.

    ``hvd.DistributedOptimizer`` returns a new optimizer object that shares the
    param groups (so learning-rate changes still reach it) but not the ``step``
    that the scheduler patched to notice ``optimizer.step()`` calls: the
    scheduler's first ``step()`` would warn "Detected call of lr_scheduler.step()
    before optimizer.step()" although the order is right. Re-pointing the
    scheduler and counting the wrapper's steps the way torch does keeps that
    check (and ``scheduler.optimizer``) truthful.
    """
    by_id = {id(o): w for o, w in zip(originals, wrapped, strict=True)}
    for scheduler in schedulers:
        target = by_id.get(id(getattr(scheduler, "optimizer", None)))
        if target is None:
            continue
        scheduler.optimizer = target
        if not hasattr(target.step, "_wrapped_by_lr_sched"):
            target.step = _counting_step(target)


def _counting_step(optimizer: Any) -> Any:
    """``optimizer.step`` that records the call as torch's LR scheduler expects."""
    step = type(optimizer).step
    ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # what LRScheduler.step checks on its first call
        return step(opt, *args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return counted


def _reduces_cuda_tensors(hvd: Any) -> bool:
    # NCCL is Horovod's GPU allreduce path next to the gloo controller; gloo itself
    # reduces host memory only.
    return bool(hvd.nccl_built())


def _broadcast_model(hvd: Any, model: torch.nn.Module, index: int, staging: bool) -> None:
    """Give every rank rank 0's parameters and buffers of ``model``."""
    state = model.state_dict()
    if staging:
        cpu_state = {k: v.detach().cpu().clone() for k, v in state.items()}
        hvd.broadcast_parameters(
            [(f"model{index}.{k}", v) for k, v in cpu_state.items()], root_rank=0
        )
        model.load_state_dict(cpu_state)
    else:
        hvd.broadcast_parameters([(f"model{index}.{k}", v) for k, v in state.items()], root_rank=0)


def _broadcast_optimizer(hvd: Any, optimizer: Any, index: int, staging: bool) -> None:
    """Give every rank rank 0's state and options of ``optimizer``."""
    if staging:
        # Horovod cannot touch CUDA tensors here: send the state pickled.
        state = hvd.broadcast_object(
            _to_cpu(optimizer.state_dict()), root_rank=0, name=f"optimizer{index}"
        )
        optimizer.load_state_dict(state)
    elif optimizer.state:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    else:
        # hvd.broadcast_optimizer_state initialises an empty state with a
        # zero-gradient step, which would count one Adam step and apply weight
        # decay once: DDP does neither. Nothing but the options to send.
        options = hvd.broadcast_object(
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            root_rank=0,
            name=f"optimizer{index}.options",
        )
        for group, group_options in zip(optimizer.param_groups, options, strict=True):
            group.update(group_options)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
