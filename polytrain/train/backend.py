"""Ray Train's ``BackendConfig`` / ``Backend``: your own driver hooks around the worker group.

Ray Train builds a custom backend as a ``BackendConfig`` subclass whose
``backend_cls`` is a ``Backend`` with ``on_start``, ``on_training_start`` and
``on_shutdown`` (driver-side hooks that run code on the workers through
``worker_group.execute(fn)``). Passed as ``DataParallelTrainer(backend_config=...)``,
such a config keeps the trainer's polytrain backend (``backend="ddp"`` etc.) and
runs your hooks around it: ``on_start`` after the backend connected a new group,
``on_training_start`` right before the loop starts on it, ``on_shutdown`` before the
backend releases the group (with dead workers too: an error there is logged). The
``worker_group`` they get is polytrain's (``execute``, ``execute_single``,
``execute_async``, ``len()``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.backend import Backend as PolytrainBackend
from polytrain.backends.core.rendezvous import Rendezvous
from polytrain.errors import ConfigError

if TYPE_CHECKING:
    from polytrain.backends.core.context import WorkerContext
    from polytrain.launchers.base import WorkerGroup

__all__ = ["Backend", "BackendConfig", "with_user_backend"]

logger = logging.getLogger(__name__)


class Backend:
    """Driver hooks of a custom backend (Ray Train's ``Backend``); the defaults do nothing."""

    #: Ray Train's switch for sharing GPUs between a node's workers; polytrain gives each
    #: worker the GPUs Ray assigned it, so only False is honoured.
    share_cuda_visible_devices: bool = False

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """After the workers of a new group are started and connected."""

    def on_training_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Right before the training loop starts on the group."""

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Before the group is released (its workers may be dead)."""


class BackendConfig:
    """A custom backend's config (Ray Train's ``BackendConfig``): names its :class:`Backend` class."""

    @property
    def backend_cls(self) -> type[Backend]:
        """The :class:`Backend` subclass whose hooks run around the worker group."""
        return Backend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A context manager factory the loop runs in (Ray Train's; default: none)."""
        return contextlib.nullcontext

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _HookedRendezvous(Rendezvous):
    """The backend's own rendezvous, with the user's hooks around it."""

    def __init__(self, inner: Rendezvous, user_config: BackendConfig) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.user_config = user_config
        self.user = user_config.backend_cls()
        if getattr(self.user, "share_cuda_visible_devices", False):
            raise ConfigError(
                f"{type(self.user).__name__}.share_cuda_visible_devices=True is not supported: each "
                f"polytrain worker sees the GPUs Ray assigned it. Leave it False."
            )

    def worker_env_vars(self) -> dict[str, str]:
        return self.inner.worker_env_vars()

    def worker_process_env(self) -> dict[str, str]:
        return self.inner.worker_process_env()

    def on_start(self, group: WorkerGroup, ctx: WorkerContext) -> None:
        self.inner.on_start(group, ctx)
        self.user.on_start(group, self.user_config)
        self.user.on_training_start(group, self.user_config)

    def on_shutdown(self, group: WorkerGroup) -> None:
        try:
            self.user.on_shutdown(group, self.user_config)
        except Exception:  # noqa: BLE001 - the backend's own release must still run
            logger.exception("%s.on_shutdown failed", type(self.user).__name__)
        self.inner.on_shutdown(group)


def with_user_backend(backend: PolytrainBackend, user_config: BackendConfig) -> PolytrainBackend:
    """``backend`` (a polytrain backend instance) with ``user_config``'s hooks around its rendezvous.

    Raises:
        ConfigError: ``user_config.backend_cls`` is not a :class:`Backend` subclass.
    """
    backend_cls = user_config.backend_cls
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, Backend)):
        raise ConfigError(
            f"{type(user_config).__name__}.backend_cls must be a polytrain.train.backend.Backend "
            f"subclass; got {backend_cls!r}."
        )
    base_cls = type(backend)

    def make_rendezvous(self: Any) -> Rendezvous:
        return _HookedRendezvous(base_cls.make_rendezvous(self), user_config)

    hooked = type(
        f"{base_cls.__name__}With{type(user_config).__name__}",
        (base_cls,),
        {"make_rendezvous": make_rendezvous},
    )
    return hooked(backend.config)
