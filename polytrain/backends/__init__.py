"""Backends: how workers talk (process groups, Horovod, sharding, DeepSpeed, TF).

Every backend implements :class:`polytrain.backends.base.Backend`; they are
looked up by name through :mod:`polytrain.backends.registry`, which imports the
backend's module (and its framework) only when it is asked for.
"""

from polytrain.backends.base import Backend, BackendConfig, Components, WorkerContext
from polytrain.backends.registry import (
    BackendSpec,
    UnknownBackendError,
    available_backends,
    describe_backends,
    get_backend,
    register_backend,
    resolve_backend_name,
)

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendSpec",
    "Components",
    "UnknownBackendError",
    "WorkerContext",
    "available_backends",
    "describe_backends",
    "get_backend",
    "register_backend",
    "resolve_backend_name",
]
