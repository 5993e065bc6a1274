"""The backend interface: a typed config, a driver side and a worker side.

A backend is a plain class with its options on the instance (no singletons). It
binds three things, looked up by name through
:mod:`polytrain.backends.registry`:

- its :class:`BackendConfig` dataclass (what ``backend_config=`` accepts);
- a :class:`~polytrain.backends.core.rendezvous.Rendezvous`: the **driver** side, which
  connects a started worker group (process group, Horovod's rendezvous server,
  TF_CONFIG) and knows no framework;
- a :class:`~polytrain.backends.core.strategy.Strategy`: the **worker** side, one per
  framework (torch: prepare / backward / step / no_sync / state dicts, with a
  :class:`~polytrain.backends.core.precision.Precision`; Keras: a ``tf.distribute``
  strategy and data for ``fit``).

The trainers and the Lightning strategies never test which backend they hold:
whatever differs between backends lives in these objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.parallelism import Parallelism, mesh_request, refuse_mesh
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.core.step_options import StepOptions
from polytrain.backends.core.strategy import Strategy, TorchStrategy, load_optimizer_states
from polytrain.compat.omegaconf_values import plain_config
from polytrain.errors import ConfigError, ConfigTypeError

__all__ = [
    "Backend",
    "BackendConfig",
    "Components",
    "Rendezvous",
    "Strategy",
    "TorchStrategy",
    "WorkerContext",
    "load_optimizer_states",
]


@dataclass
class BackendConfig:
    """Base class of the typed option set of a backend (empty for backends with no options)."""

    @classmethod
    def from_value(cls, value: Any, backend_name: str = "") -> BackendConfig:
        """Build the config from ``None``, an instance, or a mapping of field names.

        A mapping may be an OmegaConf ``DictConfig`` (its interpolations resolved).

        Raises:
            ConfigTypeError: a mapping with an unknown key, or a value of another type.
            ConfigError: a ``DictConfig`` with a missing (``???``) or unresolvable value.
        """
        value = plain_config(value, "backend_config")
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ConfigTypeError(
                    f"Unknown backend_config key(s) {unknown} for backend '{backend_name}'. "
                    f"Allowed keys: {names or 'none (this backend takes no options)'}."
                )
            return cls(**value)
        raise ConfigTypeError(
            f"backend_config for backend '{backend_name}' must be a {cls.__name__}, a dict or "
            f"None; got {type(value).__name__}: {value!r}."
        )


class Backend:
    """A named pair of a driver-side rendezvous and a worker-side strategy, with typed options.

    Subclasses set ``name``, ``framework``, ``config_cls``, ``rendezvous_cls`` and
    ``strategy_cls``; the defaults are the no-op pair (no communication, plain
    torch), which tests the executor without any framework.
    """

    name: ClassVar[str] = ""
    framework: ClassVar[str] = "torch"  # "torch" | "tensorflow"
    #: What a new worker imports in the background as soon as it starts, while the
    #: driver places the other workers and sets up (the pool's ``preload`` setting
    #: overrides it). Torch backends add their own library to this.
    preload_modules: ClassVar[tuple[str, ...]] = ("torch", "torch.distributed")
    config_cls: ClassVar[type[BackendConfig]] = BackendConfig
    rendezvous_cls: ClassVar[type[Rendezvous]] = Rendezvous
    strategy_cls: ClassVar[type[Strategy]] = TorchStrategy

    def __init__(self, config: BackendConfig | dict | None = None) -> None:
        self.config = self.config_cls.from_value(config, self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: reject settings this backend cannot run, before any worker starts.

        Raises:
            ConfigError: naming the setting, what is allowed and what to do.
        """

    def validate_step_options(self, step: StepOptions) -> None:
        """Driver: reject the trainer's step options where they clash with this backend's own.

        Subclasses that add checks call this too (it refuses ``compile=True`` where
        :attr:`compile_refusal` says why).

        Raises:
            ConfigError: naming both settings and what to do.
        """
        if step.compile:
            self.validate_compile()

    #: Why ``compile=True`` cannot run under this backend (None: it can).
    compile_refusal: str | None = None

    def validate_compile(self) -> None:
        """Driver: refuse ``compile=True`` where this backend cannot run a compiled model.

        Raises:
            ConfigError: naming the backend and why, with what to do instead.
        """
        if self.compile_refusal is not None:
            raise ConfigError(
                f"compile=True is not supported by the {self.name} backend: "
                f"{self.compile_refusal} Drop compile, or use a backend that compiles the wrapped "
                f"model: ddp, fsdp (version 2), horovod, deepspeed."
            )

    #: Why Accelerate (and the HF ``Trainer`` and TRL, which run on it) cannot train on
    #: this backend's workers; None: it can (see :meth:`accelerate_env`).
    accelerate_refusal: ClassVar[str | None] = (
        "it has no Accelerate equivalent: Accelerate drives torch.distributed as DDP, FSDP "
        "or DeepSpeed only."
    )

    def accelerate_env(self, use_gpu: bool) -> dict[str, str]:
        """The environment that makes Accelerate train the way this backend does.

        What ``accelerate launch`` would set with the equivalent Accelerate config
        (``ACCELERATE_USE_FSDP`` and ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` and its
        config, ...), beyond the ranks and devices every worker gets. An
        ``Accelerator()``, an HF ``Trainer`` or a TRL trainer built inside the loop
        reads it. Pure: no framework is imported.

        Args:
            use_gpu: whether the workers train on GPUs.

        Raises:
            ConfigError: the backend (or this backend on CPU) cannot run under
                Accelerate; the message says why and what to use instead.
        """
        if self.accelerate_refusal is not None:
            raise ConfigError(
                f"Accelerate (and the HF Trainer and TRL, which run on it) cannot train on the "
                f"{self.name or 'no-op'} backend: {self.accelerate_refusal} Use backend='ddp' "
                f"(or 'fsdp' / 'deepspeed' on GPUs)."
            )
        return {}

    #: ``parallelism=`` resolved for the group (None: data parallel over every worker).
    parallelism: Parallelism | None = None
    #: ``tp_plan=`` as the backend accepted it (None: none, or a built-in plan).
    tp_plan: Any = None

    def configure_parallelism(
        self,
        parallelism: Any,
        tp_plan: Any = None,
        *,
        num_workers: int,
        min_workers: int | None = None,
    ) -> None:
        """Driver: take the trainer's ``parallelism=`` / ``tp_plan=``, or refuse them.

        A 1-D data-parallel layout (``dp_shard`` or ``dp_replicate`` alone) is what
        every backend does already; anything else goes to :meth:`accept_parallelism`.

        Raises:
            ConfigError: sizes that do not match ``num_workers``, a layout this backend
                cannot run (naming the backend to use), ``tp_plan`` without ``tp > 1``,
                or a fixed mesh with elastic ``min_workers``.
        """
        sizes = mesh_request(parallelism, tp_plan, num_workers, min_workers)
        if sizes is None:
            self.parallelism, self.tp_plan = None, None
            return
        self.tp_plan = self.accept_parallelism(sizes, tp_plan)
        self.parallelism = sizes

    def accept_parallelism(self, sizes: Parallelism, tp_plan: Any) -> Any:
        """Driver: check a mesh layout for this backend; returns the ``tp_plan`` to keep.

        Here: only 1-D data parallelism (refused otherwise, naming the backends that
        run meshes). Backends with meshes override it.

        Raises:
            ConfigError: the layout is not supported, with the reason.
        """
        if sizes.tp == 1 and 1 in (sizes.dp_replicate, sizes.dp_shard):
            return None
        raise refuse_mesh(self.name, sizes, "it trains data parallel only")

    def data_parallel_size(self, num_workers: int) -> int:
        """Driver: how many workers read different data (TP peers share theirs)."""
        return self.parallelism.data_parallel_size if self.parallelism else num_workers

    def make_rendezvous(self) -> Rendezvous:
        """Driver: a new driver side for one worker group."""
        return self.rendezvous_cls(self.config)

    def make_strategy(self) -> Strategy:
        """Worker: a new worker side (called inside every worker)."""
        return self.strategy_cls(self.config)
