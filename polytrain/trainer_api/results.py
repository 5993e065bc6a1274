"""Reduce the per-worker metrics of an epoch into one dict."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

#: Metrics that are summed over workers rather than averaged.
SUMMED = frozenset({"num_samples", "num_tokens"})
#: Metrics where the slowest worker is the answer.
MAXIMUM = frozenset({"epoch_time_s", "time_s", "num_steps", "peak_memory_mb"})


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def reduce_worker_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Combine the metric dicts of all workers (rank order).

    Numbers are averaged weighted by each worker's ``num_samples`` (equal weights
    when a worker reports none), ``num_samples`` and ``num_tokens`` are summed, times and step counts
    take the maximum, and anything else is rank 0's value. ``samples_per_s`` and
    ``tokens_per_s`` are recomputed from the totals, ``val_perplexity`` from the
    reduced ``val_loss``.
    """
    stats = [s for s in stats if s is not None]
    if not stats:
        return {}
    weights = [float(s.get("num_samples", 1) or 0) for s in stats]
    total_weight = sum(weights)
    keys: list[str] = []
    for s in stats:
        keys.extend(k for k in s if k not in keys)
    reduced: dict[str, Any] = {}
    for key in keys:
        present = [(s[key], w) for s, w in zip(stats, weights, strict=True) if key in s]
        values = [v for v, _ in present]
        if not all(_is_number(v) for v in values):
            reduced[key] = next(s[key] for s in stats if key in s)
        elif key in SUMMED:
            reduced[key] = sum(values)
        elif key in MAXIMUM:
            reduced[key] = max(values)
        else:
            weight_sum = sum(w for _, w in present)
            if weight_sum > 0 and total_weight > 0:
                reduced[key] = sum(v * w for v, w in present) / weight_sum
            else:
                reduced[key] = sum(values) / len(values)
    epoch_time = reduced.get("epoch_time_s")
    if "num_samples" in reduced and _is_number(epoch_time) and epoch_time > 0:
        reduced["samples_per_s"] = reduced["num_samples"] / epoch_time
    if "num_tokens" in reduced:
        reduced["num_tokens"] = int(reduced["num_tokens"])
        elapsed = epoch_time if _is_number(epoch_time) else reduced.get("time_s")
        if _is_number(elapsed) and elapsed > 0:
            reduced["tokens_per_s"] = reduced["num_tokens"] / elapsed
    if "val_perplexity" in reduced and _is_number(reduced.get("val_loss")):
        # exp of the mean loss; the mean of the workers' perplexities would overstate it
        reduced["val_perplexity"] = math.exp(min(reduced["val_loss"], 700.0))
    return reduced


def is_finite_number(value: Any) -> bool:
    """True for a real number that is neither NaN nor infinite."""
    return _is_number(value) and math.isfinite(value)


#: Summed over the pieces of a call; the rest are sample-weighted means (or the last value).
_SUMMED = ("num_samples", "num_tokens", "num_steps", "epoch_time_s")
_LAST = ("num_restarts", "num_workers", "epoch")
_MAXED = ("peak_memory_mb",)


def combine_call_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One call's metrics from those of its pieces (each already reduced over the workers).

    Counts and times add up, ``samples_per_s`` is recomputed, peaks take the
    maximum, other numbers are averaged weighted by samples, the rest (``epoch``,
    ``num_restarts``, ``checkpoint_path``) come from the piece that has them last.
    """
    if len(parts) == 1:
        return parts[0]
    weights = [float(p.get("num_samples", 0) or 0) for p in parts]
    total = sum(weights) or 1.0
    combined: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in combined or key in _LAST or not isinstance(value, (int, float)):
                combined[key] = value
    for key in combined:
        values = [p[key] for p in parts if isinstance(p.get(key), (int, float))]
        if key in _SUMMED:
            combined[key] = sum(values)
        elif key in _MAXED:
            combined[key] = max(values)
        elif key in _LAST or isinstance(combined[key], bool) or len(values) != len(parts):
            continue
        elif isinstance(combined[key], float):
            combined[key] = sum(w * p[key] for w, p in zip(weights, parts, strict=True)) / total
    combined["epoch"] = parts[0].get("epoch")  # the epoch the call's batches belonged to
    if combined.get("epoch_time_s"):
        combined["samples_per_s"] = combined.get("num_samples", 0) / combined["epoch_time_s"]
        if "num_tokens" in combined:
            combined["tokens_per_s"] = combined["num_tokens"] / combined["epoch_time_s"]
    profiles = [p["profile"] for p in parts if isinstance(p.get("profile"), dict)]
    if profiles:
        combined["profile"] = {k: sum(float(p.get(k, 0.0)) for p in profiles) for k in profiles[-1]}
    return combined
