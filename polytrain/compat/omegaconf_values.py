"""OmegaConf (and so Hydra) configs wherever polytrain takes a dict of options.

A Hydra app holds its settings in ``DictConfig`` objects; ``config=cfg.model``,
``scaling_config=cfg.scaling`` or a whole run config (``load_config(cfg.trainer)``)
are accepted by converting them to plain dicts and lists with their interpolations
resolved. omegaconf is imported only when it is already loaded: a value cannot
be a ``DictConfig`` otherwise, so polytrain never imports it itself.
"""

from __future__ import annotations

import sys
from typing import Any

from polytrain.errors import ConfigError

__all__ = ["describe", "is_omegaconf", "plain_config"]


def is_omegaconf(value: Any) -> bool:
    """True for an OmegaConf ``DictConfig`` or ``ListConfig``."""
    omegaconf = sys.modules.get("omegaconf")
    return omegaconf is not None and isinstance(value, omegaconf.Container)


def describe(value: Any) -> str:
    """How messages name a config given as a mapping: ``<DictConfig 'trainer'>``, ``<dict>``."""
    if not is_omegaconf(value):
        return f"<{type(value).__name__}>"
    try:
        key = value._get_full_key(None)  # the node's place in its root config
    except Exception:  # noqa: BLE001 - a private method: name the type alone
        key = ""
    return f"<{type(value).__name__} {key!r}>" if key else f"<{type(value).__name__}>"


def plain_config(value: Any, name: str) -> Any:
    """``value`` with every OmegaConf container in it as plain dicts and lists.

    ``DictConfig`` / ``ListConfig`` values (at the top or inside plain dicts, lists
    and tuples) are converted with their interpolations resolved; anything else is
    returned as it is (the same object when it holds no OmegaConf container).

    Args:
        value: what the user passed.
        name: the option it was passed as (``"config"``, ``"backend_config"``), for messages.

    Raises:
        ConfigError: a mandatory value (``???``) that is still missing, or an
            interpolation that does not resolve; the message names the key.
    """
    if "omegaconf" not in sys.modules:
        return value
    return _convert(value, name)


def _convert(value: Any, name: str) -> Any:
    if is_omegaconf(value):
        return _to_container(value, name)
    if isinstance(value, (dict, list, tuple)):
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        converted = {key: _convert(item, name) for key, item in items}
        if all(converted[key] is item for key, item in items):
            return value
        if isinstance(value, dict):
            return converted
        return type(value)(converted.values())
    return value


def _to_container(value: Any, name: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        return OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        key = _key(exc)
        raise ConfigError(
            f"{name}: the value of {key!r} is missing ('???' in the config). Give it a value, "
            f"e.g. the override {key}=... on the Hydra command line."
        ) from None
    except OmegaConfBaseException as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{name}: {_key(exc)!r} does not resolve: {message}. Fix the interpolation "
            f"(${{...}}) or set the value directly."
        ) from None


def _key(exc: Exception) -> str:
    return str(getattr(exc, "full_key", None) or getattr(exc, "key", None) or "<the config>")
