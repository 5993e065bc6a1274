"""What the torch trainer's calls send to the workers and take back from them (driver side)."""

from __future__ import annotations

from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.configs import SCHEDULER_STEP_FREQS
from polytrain.trainer_api.torch.operator import TrainingOperator

__all__ = ["check_call_options", "driver_keys", "operator_class"]


def check_call_options(num_steps: Any, info: Any) -> None:
    """Check ``train``/``validate``'s ``num_steps`` and ``info``."""
    if num_steps is not None and (
        isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
    ):
        raise ConfigError(f"num_steps must be a positive int or None; got {num_steps!r}.")
    if info is not None and not isinstance(info, dict):
        raise ConfigTypeError(
            f"info must be a dict (or None); got {type(info).__name__}: {info!r}. RaySGD's "
            f"train(num_steps, profile, reduce_results, max_retries, info) order differs: pass "
            f"profile=, reduce_results= and max_retries= by keyword."
        )


def driver_keys(
    results: list[dict[str, Any]],
) -> tuple[Any, Any, dict[str, Any], list[Any]]:
    """Take what the workers returned for the driver out of their metrics.

    Returns rank 0's state (a dict) or state file, the data position, and every
    rank's record of the checkpoint directory it wrote (None: none written).
    """
    state = results[0].pop("_state", None)
    path = results[0].pop("_state_path", None)
    cursor = results[0]["_cursor"]
    written = []
    for result in results:
        result.pop("_cursor", None)
        written.append(result.pop("_checkpoint", None))
    return state, path, cursor, written


def operator_class(
    training_operator_cls: type[TrainingOperator] | None, scheduler_step_freq: str
) -> type[TrainingOperator]:
    """Check the options of the training step; return the operator class to use."""
    if scheduler_step_freq not in SCHEDULER_STEP_FREQS:
        raise ConfigError(
            f"scheduler_step_freq={scheduler_step_freq!r} is not supported. Must be one of "
            f"{SCHEDULER_STEP_FREQS}."
        )
    operator_cls = training_operator_cls or TrainingOperator
    if not (isinstance(operator_cls, type) and issubclass(operator_cls, TrainingOperator)):
        raise ConfigTypeError(
            f"training_operator_cls must be a subclass of polytrain.TrainingOperator; got "
            f"{operator_cls!r}."
        )
    return operator_cls
