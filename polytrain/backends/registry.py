"""Backend names, aliases and descriptions; the only place that dispatches on a name.

Entries point at ``module:Class`` strings, so listing or resolving backends
imports no framework; :func:`get_backend` imports the one module asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from polytrain.backends.base import Backend, BackendConfig
from polytrain.compat.imports import MissingDependencyError, install_hint, module_available


class UnknownBackendError(ValueError):
    """A backend name that is neither a registered name nor an alias."""


@dataclass(frozen=True)
class BackendSpec:
    """One registry entry.

    Attributes:
        name: the canonical name (``backend="..."``).
        target: ``"package.module:ClassName"`` of the :class:`Backend` subclass.
        framework: ``"torch"`` or ``"tensorflow"``: which trainer takes it.
        description: one line for listings (``polytrain check``, the README).
        aliases: other accepted spellings.
        requires: modules that must be importable for the backend to work.
    """

    name: str
    target: str
    framework: str
    description: str
    aliases: tuple[str, ...] = ()
    requires: tuple[str, ...] = field(default_factory=tuple)

    @property
    def installed(self) -> bool:
        """True when every required module can be found (nothing is imported)."""
        return all(module_available(m) for m in self.requires)


_SPECS: dict[str, BackendSpec] = {}
_ALIASES: dict[str, str] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Add a backend to the registry (also for user-defined backends).

    Raises:
        ValueError: the name or an alias is taken and ``replace`` is False.
    """
    keys = (spec.name, *spec.aliases)
    if not replace:
        for key in keys:
            if key.lower() in _ALIASES:
                raise ValueError(
                    f"Backend name '{key}' is already registered (for "
                    f"'{_ALIASES[key.lower()]}'); pass replace=True to override it."
                )
    _SPECS[spec.name] = spec
    for key in keys:
        _ALIASES[key.lower()] = spec.name


def _valid_names(framework: str | None = None) -> str:
    parts = []
    for spec in _SPECS.values():
        if framework and spec.framework != framework:
            continue
        alias = f" (alias: {', '.join(spec.aliases)})" if spec.aliases else ""
        parts.append(f"'{spec.name}'{alias}")
    return ", ".join(parts)


def resolve_backend_name(name: str) -> str:
    """Return the canonical name for ``name`` or one of its aliases.

    Raises:
        UnknownBackendError: naming the value and listing every valid name.
    """
    if not isinstance(name, str):
        raise UnknownBackendError(
            f"backend must be a name (str) or a Backend instance; got {type(name).__name__}: "
            f"{name!r}. Valid names: {_valid_names()}."
        )
    canonical = _ALIASES.get(name.strip().lower())
    if canonical is None:
        raise UnknownBackendError(f"Unknown backend '{name}'. Valid names: {_valid_names()}.")
    return canonical


def get_spec(name: str) -> BackendSpec:
    """The registry entry for a name or alias."""
    return _SPECS[resolve_backend_name(name)]


def get_backend_class(name: str, framework: str | None = None) -> type[Backend]:
    """Import and return the backend class registered under ``name``.

    Args:
        name: a name or alias.
        framework: when given, the backend must belong to it ("torch" | "tensorflow").

    Raises:
        UnknownBackendError: unknown name, or a backend of another framework.
        MissingDependencyError: the backend's package is not installed.
    """
    spec = get_spec(name)
    if framework is not None and spec.framework != framework:
        trainer = {"torch": "TorchTrainer", "tensorflow": "TFTrainer"}
        raise UnknownBackendError(
            f"Backend '{name}' is a {spec.framework} backend, and {trainer[framework]} takes "
            f"{framework} backends only: {_valid_names(framework)}. Use "
            f"{trainer[spec.framework]} for '{spec.name}'."
        )
    for module in spec.requires:
        if not module_available(module):
            raise MissingDependencyError(
                f"Backend '{spec.name}' needs '{module}', which is not installed. "
                f"Install it with: {install_hint(module)}"
            )
    module_name, class_name = spec.target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_backend(
    backend: str | Backend,
    config: BackendConfig | dict | None = None,
    framework: str | None = None,
) -> Backend:
    """Return a backend instance for a name/alias (or pass a ready instance through).

    Args:
        backend: a registered name or alias, or a :class:`Backend` instance.
        config: the backend's typed config, or a dict of its fields.
        framework: when given, reject backends of another framework.
    """
    if isinstance(backend, Backend):
        if config is not None:
            raise ValueError(
                "backend_config was given together with a Backend instance; configure the "
                "instance instead (e.g. MyBackend(config))."
            )
        if framework is not None and backend.framework != framework:
            raise UnknownBackendError(
                f"Backend instance {backend!r} is a {backend.framework} backend; this trainer "
                f"takes {framework} backends: {_valid_names(framework)}."
            )
        return backend
    return get_backend_class(backend, framework)(config)


def available_backends(framework: str | None = None, installed_only: bool = True) -> list[str]:
    """Canonical backend names, optionally only those whose packages are installed."""
    return [
        spec.name
        for spec in _SPECS.values()
        if (framework is None or spec.framework == framework)
        and (spec.installed or not installed_only)
    ]


def describe_backends() -> list[BackendSpec]:
    """Every registry entry, in registration order."""
    return list(_SPECS.values())


for _spec in (
    BackendSpec(
        "ddp",
        "polytrain.backends.ddp:DDPBackend",
        "torch",
        "PyTorch DistributedDataParallel on torch.distributed (gloo on CPU, nccl on GPU)",
        aliases=("torch",),
        requires=("torch",),
    ),
    BackendSpec(
        "horovod",
        "polytrain.backends.horovod:HorovodBackend",
        "torch",
        "Horovod ring-allreduce (gloo controller) with hvd.DistributedOptimizer",
        aliases=("hvd",),
        requires=("horovod.torch",),
    ),
    BackendSpec(
        "fairscale",
        "polytrain.backends.fairscale:FairscaleBackend",
        "torch",
        "fairscale optimizer-state sharding (OSS) with ShardedDataParallel, or FSDP on GPU",
        aliases=("sharded", "fairscale_sharded"),
        requires=("fairscale",),
    ),
    BackendSpec(
        "fsdp",
        "polytrain.backends.fsdp:FSDPBackend",
        "torch",
        "PyTorch FullyShardedDataParallel (parameters, gradients and optimizer state sharded)",
        aliases=("torch_fsdp",),
        requires=("torch",),
    ),
    BackendSpec(
        "deepspeed",
        "polytrain.backends.deepspeed:DeepSpeedBackend",
        "torch",
        "DeepSpeed ZeRO stages 0-3 (gloo fallback on CPU)",
        aliases=("ds", "zero"),
        requires=("deepspeed",),
    ),
    BackendSpec(
        "mwms",
        "polytrain.backends.tensorflow:MultiWorkerMirroredBackend",
        "tensorflow",
        "TensorFlow MultiWorkerMirroredStrategy configured through TF_CONFIG (tf_keras)",
        aliases=("tensorflow", "tf", "multi_worker_mirrored"),
        requires=("tensorflow", "tf_keras"),
    ),
):
    register_backend(_spec)
