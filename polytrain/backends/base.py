"""The backend interface.

A backend is a plain class with its state on the instance. *Driver hooks* run in
the driver process and receive the worker group; *worker hooks* run inside every
worker process (a Ray actor, or the driver itself in local mode) and receive the
:class:`Components` that the creators built. The trainer and the operator never
test which backend they hold: whatever differs between backends lives here.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class BackendConfig:
    """Base class of the typed option set of a backend (empty for backends with no options)."""

    @classmethod
    def from_value(cls, value: Any, backend_name: str = "") -> BackendConfig:
        """Build the config from ``None``, an instance, or a mapping of field names.

        Raises:
            TypeError: a mapping with an unknown key, or a value of another type.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise TypeError(
                    f"Unknown backend_config key(s) {unknown} for backend '{backend_name}'. "
                    f"Allowed keys: {names or 'none (this backend takes no options)'}."
                )
            return cls(**value)
        raise TypeError(
            f"backend_config for backend '{backend_name}' must be a {cls.__name__}, a dict or "
            f"None; got {type(value).__name__}: {value!r}."
        )


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

    ``device`` is the torch device the worker computes on (the CPU unless set).
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
    scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # backend-owned state (engines, ...)

    @property
    def model(self) -> torch.nn.Module:
        """The first (usually the only) model."""
        return self.models[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first (usually the only) optimizer."""
        return self.optimizers[0]


class Backend(abc.ABC):
    """How the workers of a group talk and how their models are wrapped.

    Subclasses set ``name``, ``framework`` and ``config_cls`` and implement
    :meth:`prepare`; the other hooks have defaults that fit plain data parallelism.
    """

    name: ClassVar[str] = ""
    framework: ClassVar[str] = "torch"  # "torch" | "tensorflow"
    config_cls: ClassVar[type[BackendConfig]] = BackendConfig

    def __init__(self, config: BackendConfig | dict | None = None) -> None:
        self.config = self.config_cls.from_value(config, self.name)

    # ----------------------------------------------------------------- driver
    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: reject settings this backend cannot run, before any worker starts."""

    def worker_env_vars(self) -> dict[str, str]:
        """Driver: environment variables every worker process must start with."""
        return {}

    def on_start(self, group: Any, ctx_template: WorkerContext) -> None:
        """Driver: rendezvous, environment and process groups, once the workers run."""

    def on_shutdown(self, group: Any) -> None:
        """Driver: release what :meth:`on_start` set up. Must tolerate dead workers."""

    # ----------------------------------------------------------------- worker
    @abc.abstractmethod
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: move to the device and wrap models, optimizers and loaders."""

    def zero_grad(self, components: Components) -> None:
        """Worker: clear the gradients of every optimizer."""
        for optimizer in components.optimizers:
            optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: back-propagate ``loss`` (scaled when a GradScaler is in use)."""
        if components.scaler is not None:
            components.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: apply the gradients (every optimizer, or only ``optimizer_index``)."""
        optimizers = (
            components.optimizers
            if optimizer_index is None
            else [components.optimizers[optimizer_index]]
        )
        scaler = components.scaler
        for optimizer in optimizers:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            scaler.update()

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: a context in which backward passes do not synchronise gradients."""
        return contextlib.nullcontext()

    def autocast(self, ctx: WorkerContext) -> contextlib.AbstractContextManager:
        """Worker: the mixed-precision context of a forward pass (``use_fp16``).

        fp16 with a GradScaler on GPU; bf16 on CPU, where fp16 kernels are slow or missing.
        """
        if not ctx.use_fp16:
            return contextlib.nullcontext()
        import torch

        if ctx.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.float16)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def make_scaler(self, ctx: WorkerContext) -> Any:
        """Worker: a GradScaler when fp16 gradients need one (GPU), else ``None``."""
        if ctx.use_fp16 and ctx.device.type == "cuda":
            import torch

            return torch.amp.GradScaler("cuda")
        return None

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Worker: the user's module inside whatever wrapper :meth:`prepare` added."""
        return getattr(model, "module", model)

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker: consolidated, backend-independent ``{"models": [...], "optimizers": [...]}``.

        Called on every rank at once (sharded backends gather here); only rank 0's
        return value is used, other ranks may return ``None``.
        """
        if ctx.world_rank != 0:
            return None
        return {
            "models": [self.unwrap_model(m).state_dict() for m in components.models],
            "optimizers": [o.state_dict() for o in components.optimizers],
        }

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load a consolidated state (as :meth:`full_state_dict` returns) on every rank."""
        for model, model_state in zip(components.models, state["models"], strict=True):
            self.unwrap_model(model).load_state_dict(model_state)
        load_optimizer_states(components.optimizers, state.get("optimizers"))

    def sample_distribution(self, ctx: WorkerContext) -> tuple[int, int]:
        """Worker: ``(num_replicas, rank)`` for the distributed samplers of the loaders."""
        return ctx.world_size, ctx.world_rank

    @contextlib.contextmanager
    def worker_scope(self, ctx: WorkerContext) -> Iterator[None]:
        """Worker: a context around every call into the worker (e.g. the CUDA device)."""
        if ctx.device.type == "cuda":
            import torch

            with torch.cuda.device(ctx.device):
                yield
        else:
            yield


def load_optimizer_states(optimizers: list[Any], states: list[Any] | None) -> None:
    """Load torch-format optimizer states; a checkpoint without them keeps fresh optimizers.

    Backends whose optimizer state has no portable form (they say so when saving)
    write ``None`` entries: the weights still load, and training resumes with a
    freshly initialised optimizer state.
    """
    if not states:
        logger.warning("The checkpoint has no optimizer state; optimizers start fresh.")
        return
    for optimizer, state in zip(optimizers, states, strict=True):
        if state is None:
            logger.warning(
                "No portable state for optimizer %s; it starts fresh.", type(optimizer).__name__
            )
            continue
        optimizer.load_state_dict(state)
