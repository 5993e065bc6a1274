"""The Lightning 1.x plugin names, kept so that old code fails with directions."""

from __future__ import annotations

from typing import Any, NoReturn

from polytrain.errors import ConfigTypeError

_REPLACEMENTS = {
    "RayPlugin": "RayStrategy",
    "HorovodRayPlugin": "RayHorovodStrategy",
    "RayHorovodPlugin": "RayHorovodStrategy",
    "RayShardedPlugin": "RayShardedStrategy",
    "RayDeepSpeedPlugin": "RayDeepSpeedStrategy",
}


class _RemovedPlugin:
    """Raises on construction: Lightning 2.x takes distributed training as a strategy.

    Raises:
        polytrain.errors.ConfigTypeError: always (a ``TypeError``), naming the replacement.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        name = type(self).__name__
        replacement = _REPLACEMENTS[name]
        given = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        raise ConfigTypeError(
            f"{name}({given}) is the Lightning 1.x spelling, passed as "
            f"`Trainer(plugins=[{name}(...)])`. Lightning 2.x takes distributed training as a "
            f"strategy: use `Trainer(strategy={replacement}({given}))` with "
            f"`from polytrain.lightning import {replacement}`."
        )


class RayPlugin(_RemovedPlugin):
    """Lightning 1.x name; use ``Trainer(strategy=RayStrategy(...))``."""


class HorovodRayPlugin(_RemovedPlugin):
    """Lightning 1.x name; use ``Trainer(strategy=RayHorovodStrategy(...))``."""


class RayHorovodPlugin(_RemovedPlugin):
    """The other order of ``HorovodRayPlugin``; use ``Trainer(strategy=RayHorovodStrategy(...))``."""


class RayShardedPlugin(_RemovedPlugin):
    """Lightning 1.x name; use ``Trainer(strategy=RayShardedStrategy(...))``."""


class RayDeepSpeedPlugin(_RemovedPlugin):
    """Lightning 1.x name; use ``Trainer(strategy=RayDeepSpeedStrategy(...))``."""
