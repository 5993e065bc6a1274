"""Quiet by default: keep third-party noise out of the console, keep warnings about the user's code.

Every worker process of a run prints what its frameworks print on import and
set-up, and Ray forwards it all to the driver: DeepSpeed's accelerator notice,
torch deprecation warnings raised inside DeepSpeed, fairscale's "trainable
params changed" at every train/eval switch, TensorFlow's C++ start-up lines.
None of it is about the user's code. :func:`install` filters exactly that:

* a warning is dropped when the code that triggered it belongs to a third-party
  framework (:data:`NOISY_PACKAGES`; torch's own wrapper frames are looked
  through), so a warning raised by the user's code (or by polytrain's) still shows;
* known log records of those frameworks (:data:`DROPPED_LOG_MESSAGES`) are dropped;
* TensorFlow's C++ logging is turned down in the workers
  (``TF_CPP_MIN_LOG_LEVEL``, see :func:`worker_env`) and its import-time lines
  are held back (:func:`quiet_import_tensorflow`).

``POLYTRAIN_VERBOSE=1`` (``polytrain --verbose``) turns all of it off. This module
is on the ground floor: it imports nothing of polytrain and no framework.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from types import FrameType, ModuleType
from typing import Any

__all__ = [
    "DROPPED_LOG_MESSAGES",
    "NOISY_PACKAGES",
    "VERBOSE_ENV",
    "install",
    "is_verbose",
    "quiet_import_tensorflow",
    "set_verbose",
    "worker_env",
]

#: Set to 1 to see every warning and log line (``polytrain --verbose`` sets it).
VERBOSE_ENV = "POLYTRAIN_VERBOSE"

#: Packages whose own warnings say nothing to the user of polytrain.
NOISY_PACKAGES = ("deepspeed", "fairscale", "horovod", "tensorflow", "tf_keras", "keras", "absl")

#: Frames looked through when deciding who triggered a warning: the deprecation
#: machinery (``typing_extensions.deprecated``) and torch's wrappers (``c10d_logger``)
#: warn on behalf of their caller.
_PASS_THROUGH = (
    "warnings",
    "typing_extensions",
    "functools",
    "contextlib",
    "torch",
    "polytrain.compat.quiet",
)

#: Logger name -> message starts to drop ("" is the root logger, where fairscale logs).
DROPPED_LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    "DeepSpeed": (
        "Setting accelerator to CPU",
        "**** You are using ZeRO with an untested optimizer",
    ),
    "": ("ShardedDDP detected that the trainable params changed",),
}

#: TensorFlow C++ log level in quiet workers: errors that matter reach Python as exceptions.
_TF_CPP_QUIET_LEVEL = "3"

_installed = False
_previous_showwarning: Any = None  # what warnings.showwarning was before install()


def is_verbose() -> bool:
    """Whether ``POLYTRAIN_VERBOSE`` asks for everything (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_verbose(verbose: bool) -> None:
    """Driver: set ``POLYTRAIN_VERBOSE`` for this process and the workers it starts."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


def worker_env() -> dict[str, str]:
    """Driver: environment variables workers need to be as quiet (or verbose) as the driver.

    Set them before the worker imports a framework (actor start-up, a Ray
    runtime_env, or the backend's ``worker_env_vars``).
    """
    if is_verbose():
        return {VERBOSE_ENV: "1"}
    return {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", _TF_CPP_QUIET_LEVEL)}


# ------------------------------------------------------------------ warnings
def _module_of(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def triggered_by_noisy_package(frame: FrameType | None) -> bool:
    """Whether the first frame outside warnings/torch wrappers belongs to a noisy package."""
    while frame is not None and _in(_module_of(frame), _PASS_THROUGH):
        frame = frame.f_back
    return frame is not None and _in(_module_of(frame), NOISY_PACKAGES)


def _quiet_showwarning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    if not is_verbose() and triggered_by_noisy_package(sys._getframe(1)):
        return
    show = _previous_showwarning or warnings._showwarning_orig  # type: ignore[attr-defined]
    show(message, category, filename, lineno, file, line)


# ------------------------------------------------------------------- logging
class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``starts`` (unless verbose)."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__("polytrain.quiet")
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        if is_verbose():
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to judge
            return True
        return not text.startswith(self.starts)


def install(verbose: bool | None = None) -> None:
    """Install the filters in this process (idempotent; nothing happens when verbose).

    Call it in every worker process at start-up and in the driver (the ``polytrain``
    command does). Filters installed here check ``POLYTRAIN_VERBOSE`` again when
    they run, so setting it later shows everything from then on.

    Args:
        verbose: overrides ``POLYTRAIN_VERBOSE`` for this call.
    """
    global _installed, _previous_showwarning
    if is_verbose() if verbose is None else verbose:
        return
    if warnings.showwarning is not _quiet_showwarning:
        # Checked each time: warnings.catch_warnings() puts the previous hook back on exit.
        _previous_showwarning = warnings.showwarning
        warnings.showwarning = _quiet_showwarning
    if not _installed:
        _installed = True
        for name, starts in DROPPED_LOG_MESSAGES.items():
            logging.getLogger(name or None).addFilter(_DropMessages(starts))


def uninstall() -> None:
    """Remove what :func:`install` added (for tests)."""
    global _installed
    if warnings.showwarning is _quiet_showwarning:
        warnings.showwarning = _previous_showwarning or warnings._showwarning_orig  # type: ignore[attr-defined]
    for name in DROPPED_LOG_MESSAGES:
        target = logging.getLogger(name or None)
        for item in list(target.filters):
            if isinstance(item, _DropMessages):
                target.removeFilter(item)
    _installed = False


# ---------------------------------------------------------------- TensorFlow
@contextlib.contextmanager
def _stderr_held_back() -> Iterator[None]:
    """Send file descriptor 2 to a temporary file; replay it only if the block raises.

    TensorFlow's C++ runtime writes its start-up lines before its log level is
    read, straight to the file descriptor, so only a redirect holds them back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def quiet_import_tensorflow() -> ModuleType:
    """Import TensorFlow without its C++ start-up lines (unless verbose).

    Call it in a worker before anything else imports TensorFlow; once imported,
    ``TF_CPP_MIN_LOG_LEVEL`` governs what the C++ runtime logs.
    """
    if "tensorflow" in sys.modules or is_verbose():
        return importlib.import_module("tensorflow")
    with _stderr_held_back():
        return importlib.import_module("tensorflow")
