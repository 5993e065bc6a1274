"""TerminationWatch: SIGTERM during train() only sets a flag; the previous handler comes back."""

from __future__ import annotations

import os
import signal
import threading

from polytrain.errors import PolytrainError, PreemptedError
from polytrain.runs.watch.termination import TerminationWatch


def test_sigterm_sets_the_flag_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        watch = TerminationWatch(enabled=True)
        with watch.watching():
            assert not watch.requested()
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread at once
            assert watch.requested() and watch.describe() == "SIGTERM"
        assert seen == []  # the watch took it, not the previous handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # restored after the block
        with watch.watching():
            assert not watch.requested()  # every call starts clean
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_no_handler_without_checkpoint_dir_or_off_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    with TerminationWatch(enabled=False).watching():
        assert signal.getsignal(signal.SIGTERM) is before
    inside = []

    def other_thread() -> None:
        with TerminationWatch(enabled=True).watching():
            inside.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert inside == [before]


def test_preempted_error_is_a_polytrain_error_with_exit_status_143():
    error = PreemptedError("stopped", checkpoint_path="/c/checkpoint_000001", signal_number=15)
    assert isinstance(error, PolytrainError)
    assert error.exit_code == 143 and error.checkpoint_path == "/c/checkpoint_000001"
