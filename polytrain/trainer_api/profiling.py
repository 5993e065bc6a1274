"""Per-phase timings of a ``train(profile=True)`` / ``validate(profile=True)`` call.

Every worker times the phases of its loop; the driver reduces them over the
workers. The phases, in seconds summed over the call's batches:

``data_s``
    waiting for the next batch and moving it to the device.
``forward_s``
    the rest of ``train_batch`` / ``validate_batch``: forward pass, loss and
    reading the metrics (what the step spends outside ``backward`` and ``step``).
``backward_s``
    :meth:`~polytrain.TrainingOperator.backward`: back-propagation and, for DDP,
    fairscale and FSDP, the gradient communication that overlaps it.
``step_s``
    :meth:`~polytrain.TrainingOperator.zero_grad` and
    :meth:`~polytrain.TrainingOperator.step`: the optimizer step (and Horovod's
    gradient allreduce, which completes there).
``other_s``
    the loop itself: schedulers, metric bookkeeping, progress reports.
``total_s``
    the worker's whole ``train_epoch`` / ``validate`` call.

A custom operator that overrides ``train_batch`` gets the same breakdown as long
as it calls the operator's ``backward``/``step``/``zero_grad`` helpers; one that
overrides ``train_epoch`` gets ``data_s`` (if it iterates the iterator it is given),
the helpers' phases, and ``other_s`` for everything else. On a GPU the timer
synchronises the device at each phase boundary, so profiling slows the step a
little: leave it off for speed measurements of the loop itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

PHASES = ("data", "backward", "step")


class _NoPhase:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_PHASE = _NoPhase()


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.timer._sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timer._sync()
        self.timer.add(self.name, time.perf_counter() - self.start)


class PhaseTimer:
    """Sums the time spent in named phases; does nothing unless ``enabled``.

    Args:
        enabled: whether to time at all (``profile=True``).
        device: the worker's device; a CUDA device is synchronised around phases.
    """

    def __init__(self, enabled: bool = False, device: Any = None) -> None:
        self.enabled = enabled
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._cuda = enabled and getattr(device, "type", None) == "cuda"
        self._device = device

    def phase(self, name: str) -> Any:
        """A context manager that adds its duration to phase ``name``."""
        return _Phase(self, name) if self.enabled else _NO_PHASE

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize(self._device)

    def report(self, total_s: float) -> dict[str, float]:
        """The phases of a call that took ``total_s`` seconds in all.

        ``forward_s`` is the time in the batch hooks (phase ``batch``) minus the
        helpers' phases inside them; ``other_s`` is what remains of ``total_s``.
        """
        totals = self.totals
        inner = totals["backward"] + totals["step"]
        batch = totals.get("batch")
        report = {
            "data_s": totals["data"],
            "forward_s": max(0.0, batch - inner) if batch is not None else 0.0,
            "backward_s": totals["backward"],
            "step_s": totals["step"],
        }
        busy = totals["data"] + (batch if batch is not None else inner)
        report["other_s"] = max(0.0, total_s - busy)
        report["total_s"] = total_s
        return report


def reduce_profiles(profiles: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The workers' profiles as one: the mean of each phase, and the slowest worker's total."""
    present = [p for p in profiles if p]
    if not present:
        return {}
    keys = [k for k in present[0] if all(k in p for p in present)]
    reduced = {key: sum(p[key] for p in present) / len(present) for key in keys}
    if "total_s" in reduced:
        reduced["max_total_s"] = max(p["total_s"] for p in present)
    return reduced
