"""The Lightning launcher's worker side: run a Trainer entry point in an actor, send rank 0's results back.

The launcher (:mod:`polytrain.lightning.launcher`) ships one pickled copy of the
Trainer, the LightningModule and the call's arguments to every worker of the group;
:func:`run_on_worker` runs the entry point there (stopping a ``fit`` at a batch for a
drain when the driver asks, :mod:`polytrain.lightning.drain_stop`) and rank 0 returns a
:class:`WorkerOutput` that :func:`recover_results` copies into the driver's Trainer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_fabric.utilities import move_data_to_device
from pytorch_lightning.trainer.states import TrainerFn, TrainerState

from polytrain.launchers.worker import STOP_HANDLER, WORKER_STATE
from polytrain.lightning import drain_stop
from polytrain.lightning.restarts import FIT_ENTRY, entry_name
from polytrain.lightning.resumable_loaders import ResumableLoaders
from polytrain.lightning.tune import TUNE_QUEUE_KEY

logger = logging.getLogger(__name__)


@dataclass
class WorkerOutput:
    """What rank 0 sends back to the driver after a Trainer entry point ran."""

    trainer_state: TrainerState
    trainer_results: Any
    model_state: dict[str, Any] | None
    callback_metrics: dict[str, Any]
    logged_metrics: dict[str, Any]
    progress_bar_metrics: dict[str, Any]
    callback_states: list[dict[str, Any] | None]
    logger_versions: list[Any]
    loop_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _to_cpu(data: Any) -> Any:
    return move_data_to_device(data, torch.device("cpu"))


def run_on_worker(
    payload: tuple[Any, Any, tuple, dict],
    cwd: str,
    tune_queue: Any,
    drain_path: str | None,
    rank_info: Any,
    device_index: int,
) -> WorkerOutput | drain_stop.DrainStopped | None:
    """Worker: run the Trainer entry point on this worker's copy of the Trainer.

    With ``drain_path`` (a fit the driver may stop for a drain) the fit stops when rank 0
    is told, on every rank at the same batch boundary, checkpoints to ``drain_path`` and
    returns :class:`~polytrain.lightning.drain_stop.DrainStopped`.
    """
    trainer, function, args, kwargs = payload
    try:
        os.chdir(cwd)  # relative paths in the user's code mean what they mean on the driver
    except OSError:
        pass  # another node without that directory: absolute paths were shipped
    # Set or cleared on every call: a reused (warm) actor may hold an earlier run's queue.
    if tune_queue is not None:
        WORKER_STATE[TUNE_QUEUE_KEY] = tune_queue
    else:
        WORKER_STATE.pop(TUNE_QUEUE_KEY, None)
    strategy = trainer.strategy
    strategy._set_worker_context(rank_info, device_index)
    if isinstance(function, str):
        function = getattr(trainer, function)
    if drain_path is None or entry_name(function) != FIT_ENTRY:
        WORKER_STATE.pop(STOP_HANDLER, None)
        strategy._loader_positions = None
        results = function(*args, **kwargs)
    else:
        world_size = strategy._worker.ctx.world_size
        notice = drain_stop.DrainNotice()
        notice.refusal = drain_stop.install_stop(trainer, notice, world_size)
        strategy._loader_positions = ResumableLoaders(world_size)
        trainer.callbacks.append(strategy._loader_positions)  # after the driver's: they zip
        WORKER_STATE[STOP_HANDLER] = notice
        try:
            results = function(*args, **kwargs)
        except drain_stop.DrainStop:
            return drain_stop.stop_at_drain(trainer, drain_path)
        finally:
            WORKER_STATE.pop(STOP_HANDLER, None)
    if rank_info.world_rank != 0:
        return None
    fitting = trainer.state.fn == TrainerFn.FITTING
    return WorkerOutput(
        trainer_state=trainer.state,
        trainer_results=_to_cpu(results),
        model_state=_to_cpu(strategy._final_model_state) if fitting else None,
        callback_metrics=_to_cpu(dict(trainer.callback_metrics)),
        logged_metrics=_to_cpu(dict(trainer.logged_metrics)),
        progress_bar_metrics=_to_cpu(dict(trainer.progress_bar_metrics)),
        callback_states=[_to_cpu(_callback_state(cb)) for cb in trainer.callbacks],
        logger_versions=[getattr(lg, "version", None) for lg in trainer.loggers],
        loop_state=_to_cpu(trainer.fit_loop.state_dict()) if fitting else None,
    )


def _callback_state(callback: Any) -> dict[str, Any] | None:
    try:
        state = callback.state_dict()
    except Exception:  # noqa: BLE001 - a user callback whose state does not serialise
        return None
    if hasattr(callback, "dirpath"):
        state = {**state, "dirpath": callback.dirpath}
    return state


def recover_results(output: WorkerOutput, trainer: Any) -> None:
    """Driver: copy rank 0's weights, metrics, callback and loop state into the Trainer."""
    if output.model_state is not None:
        module = trainer.lightning_module
        # Non-strict like Lightning's spawn launcher: configure_model/setup may have
        # added layers on the workers that the driver's module never built.
        missing, unexpected = module.load_state_dict(output.model_state, strict=False)
        if missing or unexpected:
            logger.warning(
                "Loading the workers' weights into the driver's module: missing keys %s, "
                "unexpected keys %s.",
                missing,
                unexpected,
            )
    trainer.state = output.trainer_state
    trainer.callback_metrics.update(output.callback_metrics)
    trainer.logged_metrics.update(output.logged_metrics)
    trainer.progress_bar_metrics.update(output.progress_bar_metrics)
    for callback, state in zip(trainer.callbacks, output.callback_states, strict=False):
        if not state:
            continue
        if "dirpath" in state and hasattr(callback, "dirpath"):
            callback.dirpath = state["dirpath"]
        try:
            callback.load_state_dict(state)
        except Exception:  # noqa: BLE001 - keep the run's result even if one callback differs
            logger.warning("Could not restore the state of callback %r", callback, exc_info=True)
    for lg, version in zip(trainer.loggers, output.logger_versions, strict=False):
        if version is not None and hasattr(lg, "_version"):
            lg._version = version
    if output.loop_state is not None:
        trainer.fit_loop.load_state_dict(output.loop_state)
