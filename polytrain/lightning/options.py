"""Driver-side options of the Lightning strategies: scaling, argument checks, the worker context.

A :class:`~polytrain.lightning.RayStrategy` takes its workers, resources and
placement as a :class:`~polytrain.launchers.scaling.ScalingConfig`, like the
trainers, with the same flat shortcuts (``num_workers=2``) merged the same way.
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.scaling import ScalingConfig
from polytrain.trainer_api.config import merge_flat_options


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
    return scaling


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
