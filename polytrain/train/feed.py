"""Driver side of ``report``: rank 0's reports handed, in order and as they arrive, to the run's sinks.

The report board keeps every report; while ``fit()`` runs the driver polls it
(with the worker group's other pollers, every 0.25 s; in local mode the board
calls back after each report) and passes each new entry to every sink: the
trackers of ``RunConfig(loggers=...)`` (:class:`TrackerSink`) and, inside a Tune
trial, the trial's ``tune.report`` (:mod:`polytrain.train.tuning`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polytrain.trainer_api.tracking import TrainerLoggers

#: A sink: called on the driver with one history entry (rank 0's metrics plus
#: ``_index``, ``_timestamp`` and ``_checkpoint``, the committed checkpoint's URL or None).
Sink = Callable[[dict[str, Any]], None]


def public(entry: dict[str, Any]) -> dict[str, Any]:
    """The user's metrics of a history entry (the board's own ``_`` keys left out)."""
    return {k: v for k, v in entry.items() if not k.startswith("_")}


class ReportFeed:
    """Hands every new report to the sinks, once each, in the order the board has them.

    Args:
        fetch: ``fetch(count)`` returns the board's entries after the first ``count``.
        sinks: the functions to call with each entry.
    """

    def __init__(self, fetch: Callable[[int], list[dict[str, Any]]], sinks: list[Sink]) -> None:
        self.fetch = fetch
        self.sinks = list(sinks)
        self.seen = 0

    def poll(self) -> None:
        """Pass the entries not seen yet to every sink (nothing to fetch without sinks).

        Sinks with a ``poll()`` of their own (the validations) are polled too, new
        entries or not.
        """
        if not self.sinks:
            return
        for entry in self.fetch(self.seen):
            self.seen += 1
            for sink in self.sinks:
                sink(entry)
        for sink in self.sinks:
            poll = getattr(sink, "poll", None)
            if poll is not None:
                poll()


class TrackerSink:
    """Writes rank 0's reports to the trackers of ``RunConfig(loggers=...)``.

    Each report is one record at ``step`` = its number (1, 2, ..., Tune's
    ``training_iteration``; counting on across restarts of the group), with the
    reported ``epoch`` (when it is an int; else 0) as the epoch axis. Metric names
    are kept as reported (no ``train/`` prefix: the loop names its own metrics).

    Args:
        loggers: what ``RunConfig.loggers`` holds (names and/or Logger instances).
        log_dir: where loggers given by name write.
        run_info: the run's description, recorded once (config, backend, workers).
    """

    def __init__(self, loggers: Any, log_dir: str, run_info: dict[str, Any]) -> None:
        self.loggers = TrainerLoggers(loggers, log_dir)
        self.run_info = run_info

    def __call__(self, entry: dict[str, Any]) -> None:
        metrics = public(entry)
        epoch = metrics.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            epoch = 0
        self.loggers.log("", metrics, entry["_index"] + 1, epoch, lambda: self.run_info)

    def finish(self) -> None:
        """Close every tracker (once)."""
        self.loggers.finish()
