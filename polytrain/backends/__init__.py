"""Backends: how workers talk (process groups, Horovod, sharding, DeepSpeed, TF).

A backend (:class:`polytrain.backends.core.backend.Backend`) binds a typed config, a
driver-side :class:`~polytrain.backends.core.rendezvous.Rendezvous` and a worker-side
:class:`~polytrain.backends.core.strategy.Strategy`; backends are looked up by name
through :mod:`polytrain.backends.registry`, which imports the backend's module
(and its framework) only when it is asked for.
"""

from polytrain.backends.core.backend import Backend, BackendConfig
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.precision import MixedPrecision, Precision
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.backends.core.strategy import KerasStrategy, Strategy, TorchStrategy
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
    "KerasStrategy",
    "MixedPrecision",
    "Precision",
    "Rendezvous",
    "Strategy",
    "TorchStrategy",
    "UnknownBackendError",
    "WorkerContext",
    "available_backends",
    "describe_backends",
    "get_backend",
    "register_backend",
    "resolve_backend_name",
]
