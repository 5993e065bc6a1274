"""The warm worker pool's public face: ``polytrain.pool.configure(max_idle=..., idle_timeout_s=...)``.

Workers of a trainer, Lightning call or comparison run that finished cleanly
wait here, reset and with torch and the backend imported, for the next group of
the same shape. The code lives in :mod:`polytrain.launchers.pool.warm_pool` (the settings
in :mod:`polytrain.launchers.pool.settings`, the reset in
:mod:`polytrain.launchers.pool.reset`). Importing this module does not import Ray.

Example::

    import polytrain

    polytrain.pool.configure(idle_timeout_s=600)   # a notebook: keep workers 10 minutes
    polytrain.pool.configure(enabled=False)        # or POLYTRAIN_WARM_POOL=0
    polytrain.pool.clear()                         # give every idle worker back now
    polytrain.pool.stats()                         # idle workers, hits, misses, ...
"""

from __future__ import annotations

from polytrain.launchers.pool.reset import register_reset_hook
from polytrain.launchers.pool.settings import ENV_PRELOAD
from polytrain.launchers.pool.warm_pool import (
    ENV_IDLE_TIMEOUT,
    ENV_MAX_IDLE,
    ENV_SWITCH,
    PoolSettings,
    clear,
    configure,
    get_settings,
    idle_workers,
    is_enabled,
    reset_settings,
    stats,
)

__all__ = [
    "ENV_IDLE_TIMEOUT",
    "ENV_MAX_IDLE",
    "ENV_PRELOAD",
    "ENV_SWITCH",
    "PoolSettings",
    "clear",
    "configure",
    "get_settings",
    "idle_workers",
    "is_enabled",
    "register_reset_hook",
    "reset_settings",
    "stats",
]
