"""The driver's termination signal: SIGTERM during ``train()`` becomes a checkpoint at the next boundary.

Slurm (``--signal=B:TERM@60``), Kubernetes (a pod eviction) and most schedulers send
SIGTERM some time before they kill a job; polytrain calls it the **termination
signal** (apart from a *drain*, Ray's announced loss of a worker node). While a
trainer with a ``checkpoint_dir`` runs ``train()`` in the main thread,
:class:`TerminationWatch` replaces the SIGTERM handler with one that only sets a
flag; the run loop reads the flag where a worker call ends (a step boundary, every
``every_n_steps`` batches with mid-epoch checkpoints, else the epoch end), has the
workers write a checkpoint there and raises :class:`~polytrain.errors.TerminatedError`.
The previous handler is back as soon as the call returns, so outside ``train()`` a
SIGTERM acts as it did before.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: The signals that ask a run to stop and resume later.
SIGNALS: tuple[int, ...] = (signal.SIGTERM,)


class TerminationWatch:
    """Notes a termination signal received while a trainer runs, for the loop to act on.

    Args:
        enabled: whether to install the handler at all (a trainer without a
            ``checkpoint_dir`` has nowhere to keep the state a later run resumes from).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: The signal number received during the current call, or None.
        self.received: int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        # Only a flag: the step boundary does the work (nothing here may block or raise).
        self.received = signum

    @contextlib.contextmanager
    def watching(self) -> Iterator[TerminationWatch]:
        """Install the handler for the block (main thread only); restore the previous one after."""
        self.received = None
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                # None: a handler installed from C; the default is the closest we can restore.
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def requested(self) -> bool:
        """True once a termination signal arrived during the current call."""
        return self.received is not None

    def describe(self) -> str:
        """The received signal's name (``SIGTERM``)."""
        if self.received is None:
            return "no signal"
        return signal.Signals(self.received).name
