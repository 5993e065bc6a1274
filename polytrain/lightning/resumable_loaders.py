"""Train loaders that resume mid-epoch exactly, under the Lightning strategies (worker side).

Lightning resumes a plain ``DataLoader`` mid-epoch from the epoch's first batch. For a
fit resumed at a drain checkpoint (:mod:`polytrain.lightning.drain_stop`), or at a
``ModelCheckpoint(every_n_train_steps=N)`` file after a lost worker, to continue with
the very next batch, the train loaders count the batches they yielded in the running
epoch (:func:`make_resumable`), :class:`ResumableLoaders` saves that count under a
checkpoint key of its own (:data:`POSITIONS_KEY`, which plain Lightning ignores), and
on resume the batches already trained are cut from the index sampler after its epoch
is set. Loaders with a ``state_dict`` of their own are left to Lightning.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from lightning_fabric.utilities.types import _Stateful
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

logger = logging.getLogger(__name__)

#: The checkpoint key that holds the train loaders' positions (:class:`ResumableLoaders`).
POSITIONS_KEY = "polytrain_loader_positions"

#: Lightning's warning on a mid-epoch resume, moot once the positions are restored.
_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


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
