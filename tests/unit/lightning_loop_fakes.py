"""The Lightning launcher's calls on the run loop without Ray: each worker group's run is faked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polytrain.lightning import launcher as launcher_module
from polytrain.runs.loop import RunLoop


def fake_attempts(monkeypatch: Any, attempts: list[Callable[[RunLoop], Any]]) -> list[tuple]:
    """Each attempt of the launcher's call is the next of ``attempts`` (given the run loop).

    An attempt returns every rank's outputs or an exception to raise (a lost worker,
    a drain stop). The run loop is real: its policies decide, it counts restarts and
    drains; only starting groups and running the entry point on them are left out.
    Returns the calls made: ``(args, kwargs, drain_path)`` of each attempt.
    """
    calls: list[tuple] = []

    def call_once(self, fn, payload, cwd, tune_queue, drain_path, progress=None, per_rank=None):
        _trainer, _function, args, kwargs = payload
        calls.append((args, kwargs, drain_path))
        outcome = attempts[len(calls) - 1](self)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(RunLoop, "call_once", call_once)
    monkeypatch.setattr(RunLoop, "start", lambda self, num_workers=None: self.workload.started())
    monkeypatch.setattr(launcher_module, "_put", lambda payload: payload)
    monkeypatch.setattr(launcher_module, "recover_results", lambda *a: None)
    return calls
