"""Driver side of restarting a Lightning call after a lost worker: whether, and where from.

When a worker of a :class:`~polytrain.lightning.RayStrategy` group dies (killed, out of
memory, node lost), the launcher starts a new group and runs the call again, up to the
strategy's ``max_retries`` restarts. A ``fit`` continues from the newest checkpoint
Lightning wrote during that call (``trainer.fit(model, ckpt_path=<it>)``, Lightning's own
resume: weights, optimizer and scheduler states, loop counters, callback states), found
by :class:`CheckpointFinder` in the directories of the Trainer's ``ModelCheckpoint``
callbacks; without one it starts over from what the call was given. Whether to restart
is the run loop's :class:`~polytrain.runs.policies.failure.FailurePolicy`, as for every
front end: only a lost or hung worker is retried, never an exception raised by user code.
"""

from __future__ import annotations

import inspect
import logging
import os
import stat
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

from lightning_fabric.loggers import CSVLogger, TensorBoardLogger

logger = logging.getLogger(__name__)

#: The name of the Trainer's fit entry point that the launcher runs (``Trainer._fit_impl``).
FIT_ENTRY = "_fit_impl"

#: Loggers whose version the driver can settle by listing a directory, without starting
#: a run anywhere (an experiment tracker's logger would create its run on first access).
_LOCAL_VERSIONED = (TensorBoardLogger, CSVLogger)


def entry_name(function: Callable | str) -> str:
    """The name of a Trainer entry point (``_fit_impl``, ...), given as a function or its name."""
    return function if isinstance(function, str) else getattr(function, "__name__", "")


def call_name(function: Callable | str) -> str:
    """``fit``, ``validate``, ... for the Trainer entry point ``function``."""
    return entry_name(function).strip("_").removesuffix("_impl")


def pin_logger_versions(trainer: Any) -> None:
    """Settle the version of the Trainer's TensorBoard and CSV loggers on the driver.

    Each worker group would otherwise pick the next free ``version_N`` itself, so a
    restarted group would log, and checkpoint, into a new directory. The version is
    set on the driver's loggers, which every group receives a copy of.
    """
    for trainer_logger in trainer.loggers:
        if isinstance(trainer_logger, _LOCAL_VERSIONED):
            _ = trainer_logger.version  # resolves and stores _version


def with_ckpt_path(
    function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], ckpt_path: str
) -> tuple[tuple, dict[str, Any]]:
    """The arguments of the fit entry point ``function`` with ``ckpt_path`` replaced."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.arguments["ckpt_path"] = ckpt_path
    return bound.args, bound.kwargs


def ckpt_path_of(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``ckpt_path`` argument of a call of the fit entry point ``function`` (None if not given)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    return bound.arguments.get("ckpt_path")


def checkpoint_directories(trainer: Any) -> tuple[list[str], list[str]]:
    """``(directories, unknown)``: where the Trainer's checkpoint callbacks write, as the driver sees it.

    A ``ModelCheckpoint`` without a ``dirpath`` writes where Lightning resolves it
    (``<default_root_dir>/checkpoints``, or ``<save_dir>/<name>/<version>/checkpoints``
    of the first logger). ``unknown`` describes the callbacks whose directory the driver
    cannot list: a remote URL, a first logger that is not a TensorBoard or CSV logger,
    weights-only checkpoints (a fit cannot resume from them), a custom ``Checkpoint``.
    """
    directories: list[str] = []
    unknown: list[str] = []
    for callback in trainer.checkpoint_callbacks:
        name = type(callback).__name__
        if getattr(callback, "save_weights_only", False):
            unknown.append(
                f"{name}(save_weights_only=True): a fit cannot resume from weights alone"
            )
            continue
        if not hasattr(callback, "dirpath"):
            unknown.append(f"{name}: not a ModelCheckpoint")
            continue
        dirpath = callback.dirpath if callback.dirpath is not None else _default_dir(trainer)
        if dirpath is None:
            unknown.append(
                f"{name} under logger {type(trainer.loggers[0]).__name__}: set "
                f"ModelCheckpoint(dirpath=...)"
            )
        elif "://" in str(dirpath):
            unknown.append(f"{name}(dirpath={str(dirpath)!r}): not a local path")
        else:
            directories.append(os.path.abspath(dirpath))
    return list(dict.fromkeys(directories)), unknown


def _default_dir(trainer: Any) -> str | None:
    """Lightning's directory of a ModelCheckpoint without dirpath (None: the driver cannot tell)."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "checkpoints")
    first = trainer.loggers[0]
    if not isinstance(first, _LOCAL_VERSIONED):
        return None
    save_dir = first.save_dir if first.save_dir is not None else trainer.default_root_dir
    version = first.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(save_dir, str(first.name), version, "checkpoints")


class CheckpointFinder:
    """The newest complete checkpoint written into some directories since the finder was made.

    Made on the driver before a fit's first worker group starts: files present then
    (an earlier run's) are never chosen, unless rewritten since. A checkpoint whose
    writer died while saving (a torch zip archive without its closing directory) is
    skipped with a warning. The directories must be visible to the driver: its own
    node, or storage shared with the workers.

    Args:
        directories: absolute paths of the directories to watch.
        unknown: descriptions of checkpoint writers whose directory is not watched
            (for the log line when no checkpoint is found).
    """

    def __init__(self, directories: Iterable[str], unknown: Iterable[str] = ()) -> None:
        self.directories = tuple(directories)
        self.unknown = tuple(unknown)
        self._before = self._scan()

    @classmethod
    def for_trainer(cls, trainer: Any, extra: Iterable[str] = ()) -> CheckpointFinder:
        """A finder for the directories of ``trainer``'s checkpoint callbacks and ``extra`` ones.

        ``extra``: more local directories (the launcher's drain checkpoints).
        """
        directories, unknown = checkpoint_directories(trainer)
        more = [os.path.abspath(d) for d in extra if "://" not in str(d)]
        return cls(list(dict.fromkeys(directories + more)), unknown)

    def newest(self) -> str | None:
        """The newest complete checkpoint written since the finder was made; None if there is none."""
        fresh = [
            (stamp, path) for path, stamp in self._scan().items() if self._before.get(path) != stamp
        ]
        for _, path in sorted(fresh, reverse=True):
            if is_complete(path):
                return path
            logger.warning(
                "Not resuming from %s: the file is incomplete (its writer died while saving).",
                path,
            )
        return None

    def describe_none(self) -> str:
        """Why :meth:`newest` found nothing, for the log line."""
        if not self.directories and not self.unknown:
            return "the Trainer writes no checkpoints: enable_checkpointing=True resumes a fit"
        where = ", ".join(self.directories) if self.directories else "a directory the driver sees"
        text = f"no checkpoint of this fit yet in {where}"
        if self.unknown:
            text += f"; not watched: {'; '.join(self.unknown)}"
        return text

    def _scan(self) -> dict[str, tuple[int, int]]:
        """``{path: (mtime_ns, size)}`` of every ``*.ckpt`` file in the directories."""
        found: dict[str, tuple[int, int]] = {}
        for directory in self.directories:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue  # not created yet
            for entry in entries:
                if not entry.name.endswith(".ckpt"):
                    continue
                try:
                    info = entry.stat()  # follows save_last="link" links; a dangling one fails
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found[entry.path] = (info.st_mtime_ns, info.st_size)
        return found


def is_complete(path: str) -> bool:
    """False for a torch zip checkpoint cut short (no closing directory); True otherwise.

    Only the archive's ends are read, so the check costs nothing for a large
    checkpoint. A file in torch's legacy format cannot be checked and counts as complete.
    """
    try:
        with open(path, "rb") as file:
            head = file.read(4)
    except OSError:
        return False
    if head != b"PK\x03\x04":
        return bool(head)
    return zipfile.is_zipfile(path)
