"""Drained nodes under the Lightning strategies: stop at a batch, checkpoint, resume off the node.

A cloud preemption or an autoscaler's scale-down reaches Ray as a *drain* of a node
(:mod:`polytrain.trainer_api.policies.drain`). While a ``fit`` runs, the launcher
(:mod:`polytrain.lightning.launcher`) watches Ray's draining nodes with the trainers'
:class:`~polytrain.trainer_api.policies.drain.DrainWatch`; when a node that hosts
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
(:class:`ResumableLoaders`, :func:`make_resumable`) and that position travels in every
checkpoint the workers write (a key of its own, which plain Lightning ignores).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fabric.utilities.types import _Stateful
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import TrainerStatus
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, IterableDataset

from polytrain.errors import PolytrainError

logger = logging.getLogger(__name__)

#: The directory under the Trainer's ``default_root_dir`` that holds drain checkpoints.
DRAIN_DIRNAME = "drain_checkpoints"

#: The checkpoint key that holds the train loaders' positions (:class:`ResumableLoaders`).
POSITIONS_KEY = "polytrain_loader_positions"

#: What rank 0 broadcasts at the start of a batch: go on, Lightning's SIGTERM, a drain.
GO_ON, SIGTERM, DRAIN = 0, 1, 2

#: Lightning's warning on a mid-epoch resume, moot once the positions are restored.
_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


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


# ------------------------------------------------------------------ worker side: loader positions
class _SkipFirst:
    """An index sampler without its first ``skip`` items (batches of a batch sampler)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


class _CountingIterator:
    """A loader's iterator that counts the batches it yields (the position in the epoch)."""

    def __init__(self, inner: Iterator[Any], start: int) -> None:
        self._inner = inner
        self.yielded = start

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self.yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _resumable_index_sampler(self: Any) -> Any:
    override = self.__dict__.get("_polytrain_index_sampler")
    if override is not None:
        return override
    return DataLoader._index_sampler.__get__(self)  # type: ignore[attr-defined]


def _resumable_iter(self: Any) -> _CountingIterator:
    skip = self.__dict__.pop("_polytrain_pending", 0)
    base = DataLoader._index_sampler.__get__(self)  # type: ignore[attr-defined]
    wrapped = _SkipFirst(base, skip) if skip else base
    persistent = self.__dict__.get("_iterator")
    if persistent is not None:  # persistent workers: the iterator keeps its sampler
        persistent._index_sampler = wrapped
    self.__dict__["_polytrain_index_sampler"] = wrapped
    try:
        inner = DataLoader.__iter__(self)
    finally:
        self.__dict__["_polytrain_index_sampler"] = None
    counter = _CountingIterator(inner, skip)
    self.__dict__["_polytrain_counter"] = counter
    return counter


def _resumable_reduce_ex(self: Any, protocol: Any) -> Any:
    # The class is made at run time: a copy is of the user's loader class again.
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_polytrain")}
    return (_plain_loader, (type(self)._polytrain_base, state))


def _plain_loader(cls: type, state: dict[str, Any]) -> Any:
    loader = cls.__new__(cls)
    loader.__dict__.update(state)
    return loader


_RESUMABLE_CLASSES: dict[type, type] = {}


def _resumable_class(cls: type) -> type:
    """A subclass of ``cls`` that counts the batches of an iteration and skips a restored position.

    Only ``__iter__`` and ``_index_sampler`` differ (the class must not override them:
    :func:`why_not_resumable`); it adds no slot, so an instance can take it as its class.
    """
    made = _RESUMABLE_CLASSES.get(cls)
    if made is None:
        made = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
                "_polytrain_base": cls,
                "_index_sampler": property(_resumable_index_sampler),
                "__iter__": _resumable_iter,
                "__reduce_ex__": _resumable_reduce_ex,
            },
        )
        _RESUMABLE_CLASSES[cls] = made
    return made


def is_resumable(loader: Any) -> bool:
    """True for a loader :func:`make_resumable` took."""
    return "_polytrain_base" in type(loader).__dict__


def why_not_resumable(loader: Any) -> str | None:
    """None if :func:`make_resumable` can take ``loader``, else why not."""
    if is_resumable(loader):
        return None
    if not isinstance(loader, DataLoader):
        return f"{type(loader).__name__} is not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (no sampler to skip in)"
    cls = type(loader)
    if (
        cls.__iter__ is not DataLoader.__iter__
        or cls._index_sampler is not DataLoader._index_sampler
    ):
        return f"{cls.__name__} iterates its own way (it overrides __iter__ or _index_sampler)"
    try:
        len(loader)
    except TypeError:
        return "it has no length"
    return None


def make_resumable(loader: DataLoader) -> DataLoader:
    """Give ``loader`` (this instance) a position in the epoch that a checkpoint can restore.

    The loader keeps its class's behaviour and attributes (it becomes an instance of a
    subclass made for it); it counts the batches it yields per iteration
    (:func:`loader_position`) and skips, once, the batches :func:`resume_at` names at the
    start of its next iteration, without loading them (they are cut from its index
    sampler). Call only if :func:`why_not_resumable` returns None.
    """
    if not is_resumable(loader):
        loader.__class__ = _resumable_class(type(loader))
    return loader


def loader_position(loader: Any) -> int:
    """Batches the loader's current iteration has yielded (0 before the first)."""
    counter = getattr(loader, "__dict__", {}).get("_polytrain_counter")
    return counter.yielded if counter is not None else 0


def resume_at(loader: Any, batches: int, epoch: int | None = None) -> None:
    """Have the loader's next iteration start after ``batches`` batches (once).

    ``epoch``: the sampler epoch of the iteration resumed, set now so that a loader with
    worker processes (which draw indices as soon as the iterator exists) sees it.
    """
    if batches > 0:
        loader.__dict__["_polytrain_pending"] = int(batches)
    if epoch is not None:
        for sampler in _samplers(loader):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)


def _samplers(loader: Any) -> list[Any]:
    found: dict[int, Any] = {}
    if (sampler := getattr(loader, "sampler", None)) is not None:
        found[id(sampler)] = sampler
    batch_sampler = getattr(loader, "batch_sampler", None)
    if (
        batch_sampler is not None
        and (sampler := getattr(batch_sampler, "sampler", None)) is not None
    ):
        found[id(sampler)] = sampler
    return list(found.values())


class ResumableLoaders(Callback):
    """Worker: the train loaders' positions, written into every checkpoint and restored from it.

    The strategy hands it each train loader (:meth:`track`); checkpoints carry
    ``{"world_size", "epoch", "loaders": [{"batches", "length"} or None per loader]}``
    under :data:`POSITIONS_KEY` while an epoch is under way. A resumed fit restores
    the position of each loader whose length and world size match (the same shards);
    a user loader that has ``state_dict``/``load_state_dict`` of its own is left to
    Lightning.

    Args:
        world_size: the number of workers.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._pending: list[dict[str, Any] | None] = []
        self._pending_epoch: int | None = None
        self._restored = False

    # -------------------------------------------------------- Lightning's hooks
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Add the positions of the epoch under way (nothing at an epoch's end)."""
        positions = self.positions(trainer)
        if positions is not None:
            checkpoint[POSITIONS_KEY] = positions

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the positions for the train loaders the fit is about to make."""
        saved = checkpoint.get(POSITIONS_KEY)
        self._pending, self._pending_epoch = [], None
        if not isinstance(saved, dict):
            return
        if saved.get("world_size") != self.world_size:
            logger.warning(
                "The checkpoint's data position was saved by %s workers, this fit has %d: the "
                "epoch under way restarts from its first batch.",
                saved.get("world_size"),
                self.world_size,
            )
            return
        self._pending = list(saved.get("loaders") or [])
        self._pending_epoch = saved.get("epoch")

    # -------------------------------------------------------- the strategy's side
    def track(self, loader: Any) -> Any:
        """A train loader of this fit, made resumable if it can be; restored if a position waits."""
        saved = self._pending.pop(0) if self._pending else None
        if isinstance(loader, _Stateful):
            return loader  # Lightning saves and restores it
        why = why_not_resumable(loader)
        if why is not None:
            logger.debug("Train loader %r keeps no position: %s", loader, why)
            return loader
        loader = make_resumable(loader)
        if isinstance(saved, dict):
            batches, length = int(saved.get("batches", 0)), saved.get("length")
            if length != len(loader):
                logger.warning(
                    "The checkpoint's data position is for a loader of %s batches, this one "
                    "has %d: the epoch under way restarts from its first batch.",
                    length,
                    len(loader),
                )
            else:
                resume_at(loader, batches, self._pending_epoch)
                if batches:
                    self._note_restored()
        return loader

    def positions(self, trainer: Any) -> dict[str, Any] | None:
        """The positions to save now; None at an epoch's end or without a loader that keeps one."""
        fit_loop = trainer.fit_loop
        combined = getattr(fit_loop, "_combined_loader", None)
        if combined is None:
            return None
        ready = fit_loop.epoch_loop.batch_progress.current.ready
        total = trainer.num_training_batches
        if isinstance(total, (int, float)) and ready >= total:
            return None  # the epoch is over: the next one starts from its first batch
        loaders = [
            {"batches": loader_position(dl), "length": len(dl)} if is_resumable(dl) else None
            for dl in combined.flattened
        ]
        if not any(loaders):
            return None
        return {
            "world_size": self.world_size,
            "epoch": fit_loop.epoch_progress.current.processed,
            "loaders": loaders,
        }

    def _note_restored(self) -> None:
        if not self._restored:
            self._restored = True
            # The position is restored: Lightning's warning about plain loaders does not apply.
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)


def describe_loaders(loaders: list[Any]) -> str | None:
    """Why some of a fit's train loaders resume from their first batch (None: all keep a position)."""
    reasons = []
    for loader in loaders:
        if is_resumable(loader) or isinstance(loader, _Stateful):
            continue
        why = why_not_resumable(loader)
        reasons.append(f"{type(loader).__name__}: {why}" if why else type(loader).__name__)
    return "; ".join(reasons) if reasons else None
