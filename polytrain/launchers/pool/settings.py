"""The warm pool's settings: defaults, the environment's overrides, the off switch.

:func:`polytrain.launchers.pool.warm_pool.configure` changes them in a process; the
environment variables below reach processes that code cannot (Tune trials,
through a runtime environment).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import check_int, check_number

__all__ = [
    "ENV_IDLE_TIMEOUT",
    "ENV_MAX_IDLE",
    "ENV_PRELOAD",
    "ENV_SWITCH",
    "PoolSettings",
    "get_settings",
    "is_enabled",
    "reset_settings",
    "set_settings",
]

ENV_SWITCH = "POLYTRAIN_WARM_POOL"
ENV_MAX_IDLE = "POLYTRAIN_WARM_POOL_MAX_IDLE"
ENV_IDLE_TIMEOUT = "POLYTRAIN_WARM_POOL_IDLE_TIMEOUT_S"
ENV_PRELOAD = "POLYTRAIN_PRELOAD"


@dataclass(frozen=True)
class PoolSettings:
    """How the warm pool behaves.

    Attributes:
        enabled: keep the workers of finished groups for the next group.
        max_idle: the most idle workers kept (over all groups); 0 keeps none.
        idle_timeout_s: seconds an idle group is kept before it is stopped and its
            placement group removed.
        release_on_demand: stop idle groups as soon as another placement group waits
            for resources.
        reuse_timeout_s: how long a new group waits for a pooled group's reset before
            it starts fresh actors instead.
        preload: modules every new worker imports in the background as soon as it
            starts (e.g. ``("torch", "torch._dynamo")``: torch, and what DDP's first
            construction imports); None (default): the backend's own
            (:attr:`polytrain.backends.core.backend.Backend.preload_modules`); empty: none.
    """

    enabled: bool = True
    max_idle: int = 16
    idle_timeout_s: float = 60.0
    release_on_demand: bool = True
    reuse_timeout_s: float = 30.0
    preload: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.preload is not None:
            if not isinstance(self.preload, (list, tuple)) or not all(
                isinstance(m, str) and m for m in self.preload
            ):
                raise ConfigTypeError(
                    f"pool preload must be a sequence of module names, e.g. ('torch', "
                    f"'torch._dynamo'), () for none or None for the backend's; got "
                    f"{self.preload!r}."
                )
            object.__setattr__(self, "preload", tuple(self.preload))
        for name in ("enabled", "release_on_demand"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(
                    f"pool {name} must be True or False; got {getattr(self, name)!r}."
                )
        check_int("pool max_idle", self.max_idle, 0)
        check_number("pool idle_timeout_s", self.idle_timeout_s, 0)
        check_number("pool reuse_timeout_s", self.reuse_timeout_s, 0)


def _env_settings() -> PoolSettings:
    values: dict[str, Any] = {}
    for var, name, cast in (
        (ENV_MAX_IDLE, "max_idle", int),
        (ENV_IDLE_TIMEOUT, "idle_timeout_s", float),
    ):
        text = os.environ.get(var)
        if text is None:
            continue
        try:
            values[name] = cast(text)
        except ValueError:
            raise ConfigError(
                f"{var}={text!r} is not a number; set it to a {cast.__name__} "
                f"(e.g. {var}={PoolSettings.__dataclass_fields__[name].default}) or unset it."
            ) from None
    preload = os.environ.get(ENV_PRELOAD, "").strip()
    if preload.lower() in ("none", "off", "0"):
        values["preload"] = ()
    elif preload:
        values["preload"] = tuple(m.strip() for m in preload.split(",") if m.strip())
    return PoolSettings(**values)


_settings: PoolSettings | None = None


def set_settings(settings: PoolSettings) -> None:
    """Replace this process's settings (see :func:`polytrain.launchers.pool.warm_pool.configure`)."""
    global _settings
    _settings = settings


def get_settings() -> PoolSettings:
    """The pool's current settings (the environment's, until :func:`configure` changes them)."""
    global _settings
    if _settings is None:
        _settings = _env_settings()
    return _settings


def is_enabled() -> bool:
    """True when groups go back to the pool: enabled in the settings and not switched off by env."""
    return get_settings().enabled and os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false")


def reset_settings() -> None:
    """Forget :func:`~polytrain.launchers.pool.warm_pool.configure`'s changes: back to the defaults and env."""
    global _settings
    _settings = None
