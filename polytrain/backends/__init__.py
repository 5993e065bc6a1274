"""Backends: how workers talk (process groups, Horovod, sharding, DeepSpeed, TF).

A backend (:class:`polytrain.backends.base.Backend`) binds a typed config, a
driver-side :class:`~polytrain.backends.rendezvous.Rendezvous` and a worker-side
:class:`~polytrain.backends.strategy.Strategy`; backends are looked up by name
through :mod:`polytrain.backends.registry`, which imports the backend's module
(and its framework) only when it is asked for.
"""

from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.context import Components, WorkerContext
from polytrain.backends.precision import MixedPrecision, Precision
from polytrain.backends.registry import (
    BackendSpec,
    UnknownBackendError,
    available_backends,
    describe_backends,
    get_backend,
    register_backend,
    resolve_backend_name,
)
from polytrain.backends.rendezvous import Rendezvous
from polytrain.backends.strategy import KerasStrategy, Strategy, TorchStrategy

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
