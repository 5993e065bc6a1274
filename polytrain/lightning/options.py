"""Driver-side options of the Lightning strategies: scaling, argument checks, the worker context.

A :class:`~polytrain.lightning.RayStrategy` takes its workers, resources and
placement as a :class:`~polytrain.launchers.scaling.ScalingConfig`, like the
trainers, with the same flat shortcuts (``num_workers=2``) merged the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.compat.deprecation import DRAIN_WORD, renamed
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import ScalingConfig
from polytrain.trainer_api.options.configs import merge_flat_options


def resolve_scaling(
    strategy_name: str, scaling_config: ScalingConfig | dict | None, **shortcuts: Any
) -> ScalingConfig:
    """Driver: the strategy's :class:`ScalingConfig`, from ``scaling_config`` and flat shortcuts.

    Shortcuts left at ``None`` are not given; a shortcut given next to a
    ``scaling_config`` is an error (as in the trainers). A Lightning strategy
    needs at least one Ray actor and has no elastic sizing.

    Raises:
        ConfigError: an option that is not allowed, naming the value received.
    """
    # The shortcuts first, so that their messages say what a RayStrategy allows
    # (num_workers >= 1) rather than what a trainer allows (0 = local mode).
    _check_worker_options(strategy_name, **shortcuts)
    scaling = merge_flat_options(ScalingConfig, scaling_config, "scaling_config", **shortcuts)
    _check_worker_options(
        strategy_name,
        num_workers=scaling.num_workers,
        num_cpus_per_worker=scaling.num_cpus_per_worker,
    )
    if scaling.min_workers is not None:
        raise ConfigError(
            f"{strategy_name} does not resize its worker group; got scaling_config with "
            f"min_workers={scaling.min_workers!r}. Leave min_workers at None."
        )
    given = {k: v for k, v in shortcuts.items() if v is not None}
    if isinstance(scaling_config, dict):
        given.update(scaling_config)
    _check_folded_resources(scaling, given)
    return scaling


def _check_folded_resources(scaling: ScalingConfig, given: dict[str, Any]) -> None:
    """An option given explicitly that resources_per_worker's CPU/GPU entries overrode: an error.

    ScalingConfig alone cannot tell ``use_gpu=False`` from the default; here the
    options given are known.
    """
    resources = given.get("resources_per_worker") or {}
    source = (
        f"resources_per_worker={resources!r}"
        if {"CPU", "GPU"} & set(resources)
        else f"num_gpus_per_worker={given.get('num_gpus_per_worker')!r}"
    )
    for name in ("num_cpus_per_worker", "use_gpu", "num_gpus_per_worker"):
        if name in given and given[name] != getattr(scaling, name):
            raise ConfigError(
                f"{name}={given[name]!r} disagrees with {source}, which sets {name}="
                f"{getattr(scaling, name)!r}: set it in one place."
            )


def check_init_hook(strategy_name: str, init_hook: Any) -> Callable[[], None] | None:
    """Driver: ``init_hook`` if it is a callable or None.

    Raises:
        ConfigTypeError: anything else.
    """
    if init_hook is not None and not callable(init_hook):
        raise ConfigTypeError(
            f"{strategy_name}(init_hook=...) must be a function that takes no arguments (run "
            f"on every worker before training) or None; got {type(init_hook).__name__}: "
            f"{init_hook!r}."
        )
    return init_hook


def check_max_retries(strategy_name: str, max_retries: Any) -> int:
    """Driver: ``max_retries`` if it is an int >= 0 (as ``FailureConfig.max_retries``).

    Raises:
        ConfigTypeError: not an int (a bool counts as none).
        ConfigError: a negative int.
    """
    return _check_count(
        strategy_name,
        "max_retries",
        max_retries,
        meaning="the restarts of the worker group after a lost worker, each resuming the fit "
        "from the newest Lightning checkpoint; 0 raises at the first loss",
        type_fix="Pass e.g. max_retries=3 (the default).",
        negative_fix="Pass max_retries=0 to fail at the first lost worker.",
    )


def check_max_drains(
    strategy_name: str, max_drains: Any, max_preemptions: Any = None
) -> int | None:
    """Driver: ``max_drains`` if it is None (unlimited) or an int >= 0 (as ``FailureConfig.max_drains``).

    ``max_preemptions`` is its former name (deprecated): it sets ``max_drains``.

    Raises:
        ConfigTypeError: neither None nor an int (a bool counts as neither).
        ConfigError: a negative int, or both names set to different values.
    """
    if max_preemptions is not None:
        if max_drains is not None and max_drains != max_preemptions:
            raise ConfigError(
                f"{strategy_name}(max_drains={max_drains!r}, max_preemptions="
                f"{max_preemptions!r}): max_preemptions is the former name of max_drains; "
                f"set max_drains only."
            )
        renamed(f"{strategy_name}(max_preemptions=...)", "max_drains", DRAIN_WORD)
        max_drains = max_preemptions
    if max_drains is None:
        return None
    return _check_count(
        strategy_name,
        "max_drains",
        max_drains,
        meaning="the drained nodes a fit moves off (stopping at a batch, checkpointing, "
        "resuming in a new group), counted apart from max_retries; None, the default, is "
        "unlimited",
        negative_fix="Pass max_drains=0 to stop at the first drain.",
        allowed="None or an int >= 0",
    )


def _check_count(
    strategy_name: str,
    option: str,
    value: Any,
    meaning: str,
    negative_fix: str,
    type_fix: str = "",
    allowed: str = "an int >= 0",
) -> int:
    """``value`` if it is an int >= 0 (a bool is not), else an error naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"{strategy_name}({option}=...) must be {allowed} ({meaning}); got "
            f"{type(value).__name__}: {value!r}." + (f" {type_fix}" if type_fix else "")
        )
    if value < 0:
        raise ConfigError(
            f"{strategy_name}({option}=...) must be {allowed} ({meaning}); got {value}. "
            f"{negative_fix}"
        )
    return value


def with_ddp_kwargs(
    strategy_name: str, own: list[str], backend: Backend, ddp_kwargs: dict[str, Any]
) -> Backend:
    """Driver: ``backend`` with ``ddp_kwargs`` (the strategy's extra keywords) added to its config.

    ``own`` lists the strategy's own arguments, for the messages.

    Raises:
        ConfigTypeError: the backend does not wrap models in DDP (with its own
            arguments listed, since a misspelt argument lands here too), or a keyword
            that DDP does not take.
        ConfigError: a keyword also given in ``backend_config``.
    """
    if not ddp_kwargs:
        return backend
    from polytrain.backends.core.ddp_signature import ddp_parameters
    from polytrain.backends.ddp.config import check_ddp_kwargs

    for key in ddp_kwargs:
        close = difflib.get_close_matches(key, own, n=1)
        if close and key not in ddp_parameters():
            raise ConfigTypeError(
                f"{strategy_name} got an unexpected keyword argument {key!r} (did you mean "
                f"{close[0]!r}?). Its own arguments: {own}; other keywords go to "
                f"DistributedDataParallel."
            )
    config = backend.config
    if "ddp_kwargs" not in {f.name for f in dataclasses.fields(config)}:
        raise ConfigTypeError(
            f"{strategy_name} got unexpected keyword argument(s) {sorted(ddp_kwargs)}. "
            f"Keywords that are not its own go to DistributedDataParallel, which backend "
            f"{backend.name!r} does not use (backend='ddp' does). Its own arguments: {own}."
        )
    try:
        check_ddp_kwargs(ddp_kwargs, f"{strategy_name}(**ddp_kwargs)")
    except ConfigTypeError as exc:
        raise ConfigTypeError(f"{exc} {strategy_name}'s own arguments: {own}.") from None
    twice = sorted(set(ddp_kwargs) & set(config.ddp_kwargs))
    if twice:
        raise ConfigError(
            f"DDP keyword argument(s) {twice} given both to {strategy_name}(...) and in "
            f"backend_config['ddp_kwargs']: set each in one place."
        )
    merged = {**config.ddp_kwargs, **ddp_kwargs}
    return type(backend)(dataclasses.replace(config, ddp_kwargs=merged))


def _check_worker_options(
    strategy_name: str,
    num_workers: Any = None,
    use_gpu: Any = None,
    num_cpus_per_worker: Any = None,
    **_others: Any,
) -> None:
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1
    ):
        raise ConfigError(
            f"num_workers must be an int >= 1 (the number of Ray actors that train); got "
            f"{num_workers!r}. To train in the driver process, use a plain Lightning "
            f"strategy instead of {strategy_name}."
        )
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise ConfigError(f"use_gpu must be True or False; got {use_gpu!r}.")
    if num_cpus_per_worker is not None and (
        isinstance(num_cpus_per_worker, bool)
        or not isinstance(num_cpus_per_worker, (int, float))
        or num_cpus_per_worker <= 0
    ):
        raise ConfigError(f"num_cpus_per_worker must be a number > 0; got {num_cpus_per_worker!r}.")


def scaling_field(name: str, doc: str) -> property:
    """A read-only property of a strategy that reads field ``name`` of its ``scaling``."""
    return property(lambda self: getattr(self.scaling, name), doc=doc)


def reject_backend(strategy_name: str, kwargs: dict[str, Any]) -> None:
    """Driver: refuse ``backend=`` on a strategy whose backend is fixed.

    Raises:
        ConfigTypeError: ``kwargs`` holds ``backend``.
    """
    if "backend" in kwargs:
        raise ConfigTypeError(
            f"{strategy_name} fixes the backend; got backend={kwargs['backend']!r}. Use "
            f"RayStrategy(backend={kwargs['backend']!r}, ...) to choose another one."
        )
