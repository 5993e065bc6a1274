"""Drained nodes under the Lightning strategies: stop at a batch, checkpoint, resume off the node.

A cloud preemption or an autoscaler's scale-down reaches Ray as a *drain* of a node
(:mod:`polytrain.runs.watch.drains`). While a ``fit`` runs, the launcher
(:mod:`polytrain.lightning.launcher`) runs on the run loop, which watches Ray's
draining nodes with its :class:`~polytrain.runs.watch.drains.DrainWatch`; when a node that hosts
workers starts draining, it hands rank 0 a notice through the worker's monitor
channel (:class:`DrainNotice`, answered from the monitor thread while training runs).

Rank 0 alone decides, and Lightning already makes its decision the decision of every
rank: at the start of every training batch Lightning's epoch loop broadcasts rank 0's
"stop" flag (``_TrainingEpochLoop._broadcast_sigterm_tensor``, there for SIGTERM).
:func:`install_stop` widens that one broadcast to carry "stop for a drain" too
(:func:`broadcast_stop`), so every rank raises :class:`DrainStop` at the same batch
boundary, with no extra collective and no extra round trip. Setting Lightning's own
``received_sigterm`` on rank 0 would not do: Lightning also checks it locally at the
end of every batch, so rank 0 would leave alone while the others wait in the next
batch's broadcast. A single worker has no broadcast; there the check runs at the start
of the epoch loop's ``advance``, the same place.

The worker then writes a checkpoint at that boundary with ``trainer.save_checkpoint``
on every rank (a collective for the sharded backends), renamed into place by rank 0
once complete (:func:`save_drain_checkpoint`), and the launcher resumes the fit from it
in a group off the node. For the resumed fit to continue with the very next batch, the
train loaders remember how many batches they yielded in the running epoch
(:mod:`polytrain.lightning.resumable_loaders`) and that position travels in every
checkpoint the workers write (a key of its own, which plain Lightning ignores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.trainer.states import TrainerStatus
from pytorch_lightning.utilities.exceptions import SIGTERMException

from polytrain.errors import PolytrainError
from polytrain.lightning.resumable_loaders import describe_loaders

logger = logging.getLogger(__name__)

#: The directory under the Trainer's ``default_root_dir`` that holds drain checkpoints.
DRAIN_DIRNAME = "drain_checkpoints"

#: What rank 0 broadcasts at the start of a batch: go on, Lightning's SIGTERM, a drain.
GO_ON, SIGTERM, DRAIN = 0, 1, 2


class DrainStop(SIGTERMException, PolytrainError):
    """Raised on every rank at the same batch boundary: a node of the group drains.

    A :class:`~pytorch_lightning.utilities.exceptions.SIGTERMException`, raised by the
    epoch loop exactly where Lightning raises one for SIGTERM (no user code lies between
    it and the worker's entry point). The worker catches it, checkpoints and tells the
    driver (:class:`DrainStopped`); a real SIGTERM still raises Lightning's plain
    ``SIGTERMException``.
    """


@dataclass(frozen=True)
class DrainStopped:
    """What a worker returns when a drain stopped its fit at a checkpoint (the driver reads rank 0's).

    Attributes:
        checkpoint_path: the complete checkpoint (rank 0; None on the other ranks).
        epoch: the epoch the fit stopped in.
        batch: the batches of that epoch already trained (the next one is ``batch``).
        global_step: optimizer steps so far.
    """

    checkpoint_path: str | None
    epoch: int
    batch: int
    global_step: int

    def where(self) -> str:
        """``epoch E, batch B (global step S)`` for a log line."""
        return f"epoch {self.epoch}, batch {self.batch} (global step {self.global_step})"


# ------------------------------------------------------------------ driver side
def drain_directory(default_root_dir: str) -> str:
    """Where the drain checkpoints of a Trainer with this ``default_root_dir`` go."""
    return os.path.join(default_root_dir, DRAIN_DIRNAME)


def drain_checkpoint_path(default_root_dir: str, token: str, number: int) -> str:
    """The path of the ``number``-th drain checkpoint of the fit ``token`` (a unique string)."""
    return os.path.join(drain_directory(default_root_dir), f"drain-{token}-{number}.ckpt")


def new_token() -> str:
    """A short unique string naming one fit's drain checkpoints."""
    return uuid.uuid4().hex[:8]


def remove_checkpoint(path: str) -> None:
    """Delete a drain checkpoint (and its directory once empty); a failure is logged, not raised."""
    try:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)
        if "://" not in path:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))  # only if empty
    except Exception as exc:  # noqa: BLE001 - a stray file is not worth failing the fit
        logger.warning("Could not remove the drain checkpoint %s: %s", path, exc)


def notice_reply(reply: Any) -> tuple[bool, str | None]:
    """``(delivered, refusal)`` from rank 0's answer to a drain notice.

    ``None`` (no handler yet: the call was still starting) is not delivered: send it
    again. ``{"ok": False, "why": W}`` is delivered and refused, with the reason W.
    """
    if not isinstance(reply, dict):
        return False, None
    if reply.get("ok"):
        return True, None
    return True, str(reply.get("why") or "the worker cannot stop this call at a batch")


# ------------------------------------------------------------------ worker side: the notice
class DrainNotice:
    """The worker's handler of a drain notice (``WORKER_STATE[STOP_HANDLER]``).

    Called from the actor's monitor thread with the driver's request; the training
    thread reads :attr:`requested` at batch boundaries (only rank 0's counts).

    Args:
        refusal: why this call cannot stop at a batch (None: it can).
    """

    def __init__(self, refusal: str | None = None) -> None:
        self.refusal = refusal
        self._requested = threading.Event()

    @property
    def requested(self) -> bool:
        """True once the driver asked for a stop."""
        return self._requested.is_set()

    def request(self) -> None:
        """Ask for a stop at the next batch boundary (what the driver's notice does)."""
        self._requested.set()

    def __call__(self, request: Any) -> dict[str, Any] | None:
        """Answer a monitor-channel request: ``{"drain": True}`` asks for the stop.

        Returns ``{"ok": True}``, ``{"ok": False, "why": ...}`` when this call cannot
        stop at a batch, or None for a request that is not a drain notice.
        """
        if not isinstance(request, dict) or not request.get("drain"):
            return None
        if self.refusal is not None:
            return {"ok": False, "why": self.refusal}
        self.request()
        return {"ok": True}


def stop_code(drain_requested: bool, received_sigterm: bool) -> int:
    """What rank 0 broadcasts: :data:`SIGTERM` wins over :data:`DRAIN` (the process is asked to end)."""
    if received_sigterm:
        return SIGTERM
    return DRAIN if drain_requested else GO_ON


def raise_for(code: int) -> None:
    """Raise what ``code`` (the broadcast value) means: nothing, SIGTERMException or DrainStop."""
    if code == DRAIN:
        raise DrainStop()
    if code == SIGTERM:
        raise SIGTERMException()


def broadcast_stop(epoch_loop: Any, notice: DrainNotice) -> None:
    """The epoch loop's per-batch broadcast of rank 0's stop flag, carrying drains too.

    Lightning's ``_broadcast_sigterm_tensor`` with one more value: the same single
    broadcast from rank 0, the same barrier before every rank raises together.
    """
    trainer = epoch_loop.trainer
    code = stop_code(notice.requested, bool(getattr(trainer, "received_sigterm", False)))
    try:
        flag = torch.tensor([code], device=trainer.strategy.root_device)
        torch.distributed.broadcast(flag, src=0)
        code = int(flag.item())
    except Exception:  # noqa: BLE001 - as Lightning: a failed broadcast stops nobody
        code = GO_ON
    if code != GO_ON:
        with contextlib.suppress(Exception):
            torch.distributed.barrier()  # every rank leaves together
        raise_for(code)


def install_stop(trainer: Any, notice: DrainNotice, world_size: int) -> str | None:
    """Make ``trainer``'s fit stop at a batch boundary once ``notice`` is requested on rank 0.

    Returns None when installed, else why it cannot be (the notice refuses then).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if world_size > 1:
        if not callable(getattr(epoch_loop, "_broadcast_sigterm_tensor", None)):
            return (
                "this Lightning version has no per-batch stop broadcast "
                "(_TrainingEpochLoop._broadcast_sigterm_tensor)"
            )
        epoch_loop._broadcast_sigterm_tensor = lambda: broadcast_stop(epoch_loop, notice)
        return None
    advance = epoch_loop.advance

    def advance_or_stop(*args: Any, **kwargs: Any) -> Any:
        if notice.requested and not getattr(trainer, "received_sigterm", False):
            raise DrainStop()
        return advance(*args, **kwargs)

    epoch_loop.advance = advance_or_stop
    return None


def save_drain_checkpoint(trainer: Any, path: str, is_rank_zero: bool) -> None:
    """Every rank: write the checkpoint of this batch boundary to ``path``, atomically.

    ``trainer.save_checkpoint`` runs on every rank (the sharded backends gather the
    state there); rank 0 writes ``<path>.part`` and renames it to ``path`` once it is
    complete, so a reader of ``*.ckpt`` files never sees half a checkpoint.
    """
    partial = path + ".part"
    trainer.save_checkpoint(partial)
    if is_rank_zero:
        get_filesystem(path).mv(partial, path)


def stop_at_drain(trainer: Any, path: str) -> DrainStopped:
    """Every rank, after :class:`DrainStop`: checkpoint this boundary to ``path``, leave the fit.

    Returns what the driver needs (the path on rank 0 only).
    """
    position = DrainStopped(
        checkpoint_path=path if trainer.is_global_zero else None,
        epoch=int(trainer.current_epoch),
        batch=int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
        global_step=int(trainer.global_step),
    )
    if trainer.is_global_zero:
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        plain = describe_loaders(list(combined.flattened)) if combined is not None else None
        if plain is not None and position.batch:
            logger.warning(
                "Drain stop at %s: train loader(s) %s keep no position, so the resumed fit "
                "starts this epoch's order again (Lightning's mid-epoch resume of a plain "
                "iterable).",
                position.where(),
                plain,
            )
    with _as_saved_on_last(trainer):
        save_drain_checkpoint(trainer, path, trainer.is_global_zero)
    leave_fit(trainer)
    return position


@contextlib.contextmanager
def _as_saved_on_last(trainer: Any) -> Iterator[None]:
    """Save the logger step counter as Lightning expects of a checkpoint taken at a batch's end.

    When the batch before the stop ran validation, Lightning's resume replays that
    batch's end (without training it) and counts ``_batches_that_stepped`` (the logger's
    step) once more, as for a checkpoint written at validation end, before the count
    moved on. The stop comes after the count moved on: save it one lower then.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    try:
        shift = bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # noqa: BLE001 - another Lightning: only the logger's step is at stake
        shift = False
    shift = shift and epoch_loop._batches_that_stepped > 0
    if shift:
        epoch_loop._batches_that_stepped -= 1
    try:
        yield
    finally:
        if shift:
            epoch_loop._batches_that_stepped += 1


def leave_fit(trainer: Any) -> None:
    """After a drain stop: tear the Trainer down as an interrupted fit, flushing the loggers.

    The loggers are saved, not finalized: the run goes on in the next group.
    """
    trainer.state.status = TrainerStatus.INTERRUPTED  # RayStrategy.teardown gathers nothing then
    for trainer_logger in trainer.loggers:
        try:
            trainer_logger.save()
        except Exception as exc:  # noqa: BLE001 - the checkpoint matters, not the log flush
            logger.warning("Could not flush logger %r at the drain stop: %s", trainer_logger, exc)
    trainer._teardown()
