"""The backend registry: every fact polytrain knows about a backend, in one entry each.

An entry (:class:`BackendSpec`) names the backend, its aliases, framework,
description, the modules it needs and the extra that installs them (so install
hints, ``polytrain check`` rows and error messages derive from it), and the
cases the shared backend test-suite runs it with. Entries point at
``module:Class`` strings, so listing or resolving backends imports no
framework; :func:`get_backend` imports the one module asked for. This is the
only place that dispatches on a backend's name.

A new backend is its own module (a :class:`~polytrain.backends.core.backend.Backend`
subclass binding a config, a rendezvous and a strategy) plus one
:func:`register_backend` call below (plus its extra in ``setup.cfg``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

from polytrain.backends.core.backend import Backend, BackendConfig
from polytrain.compat.imports import install_hint, module_available, register_install_hint
from polytrain.compat.omegaconf_values import plain_config
from polytrain.errors import ConfigError, MissingDependencyError, UnknownBackendError

__all__ = [
    "BackendSpec",
    "TestCase",
    "UnknownBackendError",
    "available_backends",
    "describe_backends",
    "get_backend",
    "get_backend_class",
    "get_launcher_env_class",
    "get_spec",
    "register_backend",
    "resolve_backend_name",
]


@dataclass(frozen=True)
class TestCase:
    """One way the shared backend test-suite runs a backend.

    Attributes:
        id: the pytest id (``"deepspeed-zero2"``).
        backend_config: the ``backend_config`` of this case.
        parity_tol: the largest parameter difference allowed against 2-worker DDP
            after the parity run (0.0: bit-identical).
    """

    __test__ = False  # not a pytest class

    id: str
    backend_config: dict[str, Any] | None = None
    parity_tol: float = 1e-5


@dataclass(frozen=True)
class BackendSpec:
    """One registry entry: everything polytrain knows about a backend.

    Attributes:
        name: the canonical name (``backend="..."``).
        target: ``"package.module:ClassName"`` of the :class:`Backend` subclass.
        framework: ``"torch"`` or ``"tensorflow"``: which trainer takes it.
        description: one line for listings (``polytrain check``, the README).
        aliases: other accepted spellings.
        requires: modules that must be importable for the backend to work.
        extra: the ``polytrain[...]`` extra that installs them (None: a core dependency).
        install: the install command when ``pip install "polytrain[extra]"`` is not
            enough (Horovod is built against the installed torch).
        test_cases: how the shared backend test-suite runs it.
        presets: aliases that also set options, ``{alias: backend_config}``; e.g.
            RaySGD's ``backend="gloo"`` is ``ddp`` with ``dist_backend="gloo"``.
        launcher: ``"module:Class"`` of the
            :class:`~polytrain.backends.core.launch_env.LauncherEnv` that gives an
            unmodified script this backend's native launcher environment under
            ``polytrain launch`` (None: the backend has no launcher of its own).
    """

    name: str
    target: str
    framework: str
    description: str
    aliases: tuple[str, ...] = ()
    requires: tuple[str, ...] = field(default_factory=tuple)
    extra: str | None = None
    install: str | None = None
    test_cases: tuple[TestCase, ...] = ()
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    launcher: str | None = None

    @property
    def installed(self) -> bool:
        """True when every required module can be found (nothing is imported)."""
        return all(module_available(m) for m in self.requires)

    @property
    def missing(self) -> list[str]:
        """The required modules that cannot be found."""
        return [m for m in self.requires if not module_available(m)]

    @property
    def install_hint(self) -> str:
        """The command that installs what this backend needs."""
        if self.install:
            return self.install
        if self.extra:
            return f'pip install "polytrain[{self.extra}]"'
        return install_hint((self.missing or list(self.requires) or ["polytrain"])[0])


_SPECS: dict[str, BackendSpec] = {}
_ALIASES: dict[str, str] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Add a backend to the registry (also for user-defined backends).

    Raises:
        ConfigError: the name or an alias is taken and ``replace`` is False.
    """
    keys = (spec.name, *spec.aliases, *spec.presets)
    if not replace:
        for key in keys:
            if key.lower() in _ALIASES:
                raise ConfigError(
                    f"Backend name '{key}' is already registered (for "
                    f"'{_ALIASES[key.lower()]}'); pass replace=True to override it."
                )
    _SPECS[spec.name] = spec
    for key in keys:
        _ALIASES[key.lower()] = spec.name
    if spec.extra or spec.install:
        for module in spec.requires:
            register_install_hint(module, spec.install_hint)


def _valid_names(framework: str | None = None) -> str:
    parts = []
    for spec in _SPECS.values():
        if framework and spec.framework != framework:
            continue
        aliases = [*spec.aliases, *(f"{p} = {spec.name} with {c}" for p, c in spec.presets.items())]
        alias = f" (alias: {', '.join(aliases)})" if aliases else ""
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
    if spec.missing:
        raise MissingDependencyError(
            f"Backend '{spec.name}' needs '{spec.missing[0]}', which is not installed. "
            f"Install it with: {spec.install_hint}"
        )
    module_name, class_name = spec.target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_launcher_env_class(name: str) -> type:
    """Import the :class:`~polytrain.backends.core.launch_env.LauncherEnv` of a backend.

    Raises:
        UnknownBackendError: an unknown name, or a backend without a launcher of its own.
        MissingDependencyError: the backend's package is not installed.
    """
    spec = get_spec(name)
    if spec.launcher is None:
        with_launcher = ", ".join(s.name for s in _SPECS.values() if s.launcher)
        raise UnknownBackendError(
            f"polytrain launch --backend {name!r}: '{spec.name}' has no launcher environment; "
            f"choose one of {with_launcher} (a torch.distributed script runs under 'ddp', "
            f"torchrun's environment)."
        )
    if spec.missing:
        raise MissingDependencyError(
            f"polytrain launch --backend {spec.name} needs '{spec.missing[0]}', which is not "
            f"installed. Install it with: {spec.install_hint}"
        )
    module_name, class_name = spec.launcher.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_backend(
    backend: str | Backend,
    config: BackendConfig | dict | None = None,
    framework: str | None = None,
) -> Backend:
    """Return a backend instance for a name/alias (or pass a ready instance through).

    Args:
        backend: a registered name or alias, or a :class:`Backend` instance.
        config: the backend's typed config, or a dict of its fields (an OmegaConf
            ``DictConfig`` too).
        framework: when given, reject backends of another framework.
    """
    config = plain_config(config, "backend_config")
    if isinstance(backend, str):
        config = _with_preset(backend, config)
    if isinstance(backend, Backend):
        if config is not None:
            raise ConfigError(
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


def _with_preset(name: str, config: BackendConfig | dict | None) -> BackendConfig | dict | None:
    """Merge the options a preset alias (``"gloo"``) sets into ``config``; a conflict is an error."""
    key = name.strip().lower() if isinstance(name, str) else name
    spec = get_spec(name)
    preset = spec.presets.get(key)
    if not preset:
        return config
    if config is None:
        return dict(preset)
    given = config if isinstance(config, dict) else dataclasses.asdict(config)
    clashes = {k: given[k] for k, v in preset.items() if k in given and given[k] != v}
    if clashes:
        raise ConfigError(
            f"backend={name!r} means backend '{spec.name}' with {preset}, but backend_config "
            f"sets {clashes}. Use backend='{spec.name}' with your backend_config, or drop "
            f"those keys."
        )
    if isinstance(config, dict):
        return {**config, **preset}
    return dataclasses.replace(config, **preset)


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


_HOROVOD_BUILD = (
    "horovod 0.28.1 must be built against the installed torch: run "
    "`bash scripts/install_horovod.sh` (it wraps the compiler for C++17 and builds with gloo)"
)

for _spec in (
    BackendSpec(
        "ddp",
        "polytrain.backends.ddp.backend:DDPBackend",
        "torch",
        "PyTorch DistributedDataParallel on torch.distributed (gloo on CPU, nccl on GPU)",
        aliases=("torch",),
        requires=("torch",),
        test_cases=(TestCase("ddp", None, 0.0),),
        presets={"gloo": {"dist_backend": "gloo"}, "nccl": {"dist_backend": "nccl"}},
        launcher="polytrain.backends.core.launch_env:TorchrunEnv",
    ),
    BackendSpec(
        "horovod",
        "polytrain.backends.horovod.backend:HorovodBackend",
        "torch",
        "Horovod ring-allreduce (gloo controller) with hvd.DistributedOptimizer",
        aliases=("hvd",),
        requires=("horovod.torch",),
        extra="horovod",
        install=_HOROVOD_BUILD,
        test_cases=(TestCase("horovod"),),
        launcher="polytrain.backends.horovod.launch_env:HorovodrunEnv",
    ),
    BackendSpec(
        "fairscale",
        "polytrain.backends.fairscale.backend:FairscaleBackend",
        "torch",
        "fairscale optimizer-state sharding (OSS) with ShardedDataParallel, or FSDP on GPU",
        aliases=("sharded", "fairscale_sharded"),
        requires=("fairscale",),
        extra="fairscale",
        test_cases=(
            TestCase("fairscale-oss", {"mode": "oss"}),
            TestCase("fairscale-sddp", {"mode": "sddp"}),
        ),
        launcher="polytrain.backends.core.launch_env:TorchrunEnv",
    ),
    BackendSpec(
        "fsdp",
        "polytrain.backends.fsdp.backend:FSDPBackend",
        "torch",
        "PyTorch FSDP: fully_shard (FSDP2, default) or FullyShardedDataParallel (version=1)",
        aliases=("torch_fsdp",),
        requires=("torch",),
        test_cases=(TestCase("fsdp"), TestCase("fsdp-v1", {"version": 1})),
        launcher="polytrain.backends.core.launch_env:TorchrunEnv",
    ),
    BackendSpec(
        "deepspeed",
        "polytrain.backends.deepspeed.backend:DeepSpeedBackend",
        "torch",
        "DeepSpeed ZeRO stages 0-3 (gloo fallback on CPU)",
        aliases=("ds", "zero"),
        requires=("deepspeed",),
        extra="deepspeed",
        test_cases=(
            TestCase("deepspeed-zero1", {"stage": 1}),
            TestCase("deepspeed-zero2", {"stage": 2}),
            TestCase("deepspeed-zero3", {"stage": 3}, parity_tol=1e-4),
        ),
        launcher="polytrain.backends.deepspeed.launch_env:DeepSpeedLauncherEnv",
    ),
    BackendSpec(
        "mwms",
        "polytrain.backends.tensorflow.backend:MultiWorkerMirroredBackend",
        "tensorflow",
        "TensorFlow MultiWorkerMirroredStrategy configured through TF_CONFIG (tf_keras)",
        aliases=("tensorflow", "tf", "multi_worker_mirrored"),
        requires=("tensorflow", "tf_keras"),
        extra="tensorflow",
        test_cases=(TestCase("mwms"),),
    ),
):
    register_backend(_spec)
