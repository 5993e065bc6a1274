"""Flag backends whose results differ from the others' on the same seed and data.

Backends of one framework, given the same creators, seed and data, should end
with the same losses up to float noise (the parity tests hold them to that).
When one differs by more than a tolerance (default 2 % relative) a setting
usually changed the arithmetic: precision, gradient clipping or how the loss is
reduced over the workers. :func:`flag_divergence` marks those results and says
which of their settings is the likely cause.

Each backend is compared with the first backend of its own framework that ran
(the reference): a Keras model and a torch model start from different weights,
so results across frameworks are not expected to agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError

__all__ = ["DEFAULT_TOLERANCE", "METRICS", "Divergence", "flag_divergence", "likely_causes"]

#: The default relative tolerance (2 %).
DEFAULT_TOLERANCE = 0.02

#: The compared metrics: result attribute -> label.
METRICS = {"final_loss": "final loss", "val_loss": "val loss", "val_accuracy": "val accuracy"}

GENERIC_CAUSES = (
    "precision (use_fp16, a backend's fp16/bf16 or compression setting), gradient clipping "
    "(e.g. DeepSpeed's gradient_clipping), loss reduction (sum instead of mean over workers, "
    "e.g. Horovod's op='sum', or a loss with reduction='sum')"
)


@dataclass(frozen=True)
class Divergence:
    """One metric of one backend that differs from the reference backend's."""

    metric: str
    value: float
    reference: float
    reference_backend: str
    relative: float

    def describe(self) -> str:
        """E.g. ``final loss 1.93 vs ddp 1.84 (+4.9%)``."""
        rel = "n/a" if math.isinf(self.relative) else f"{self.relative:+.1%}"
        return (
            f"{METRICS.get(self.metric, self.metric)} {self.value:.4g} vs "
            f"{self.reference_backend} {self.reference:.4g} ({rel})"
        )


def relative_difference(value: float, reference: float) -> float:
    """``(value - reference) / |reference|``; inf when only one is finite or the reference is 0."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return 0.0 if (math.isnan(value) and math.isnan(reference)) else math.inf
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return (value - reference) / abs(reference)


def _is_set(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() not in ("", "none", "no", "false", "off", "fp32", "float32")
    return value not in (None, False, 0, 0.0) and value != {}


def likely_causes(settings: Mapping[str, Any]) -> list[str]:
    """The settings among ``settings`` (flattened, dotted keys) that usually change results.

    Looks at the key names: clipping (``*clip*``), precision (``*fp16*``, ``*bf16*``,
    ``*precision*``, ``*compression*``, ``*dtype*``) and reduction (``op``,
    ``reduction``, ``reduce_op``) when set to something other than the default.
    """
    causes = []
    for key, value in settings.items():
        name = key.lower()
        leaf = name.rsplit(".", 1)[-1]
        if "clip" in name and _is_set(value):
            causes.append(f"gradient clipping ({key}={value})")
        elif any(t in name for t in ("fp16", "bf16", "precision", "compression", "dtype")):
            if _is_set(value):
                causes.append(f"precision ({key}={value})")
        elif leaf in ("op", "reduction", "reduce_op") and _is_set(value):
            if str(value).lower() not in ("average", "mean", "avg"):
                causes.append(f"loss reduction ({key}={value})")
    return causes


def _check_tolerance(tolerance: float) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise ConfigError(
            f"tolerance must be a relative difference >= 0 (0.02 is 2 %); got {tolerance!r}."
        )
    return float(tolerance)


def flag_divergence(results: Sequence[Any], tolerance: float = DEFAULT_TOLERANCE) -> list[Any]:
    """Mark the results whose metrics differ from their framework's reference by > ``tolerance``.

    Sets ``reference_backend``, ``relative_final_loss``, ``divergences`` (a list of
    :class:`Divergence`) and ``divergence_hint`` on each result that ran (``status ==
    "ok"``); the reference of a framework is its first result that ran. Returns the
    flagged results.

    Raises:
        ConfigError: a negative or non-numeric tolerance.
    """
    tolerance = _check_tolerance(tolerance)
    references: dict[str, Any] = {}
    flagged = []
    for result in results:
        result.divergences, result.divergence_hint = [], ""
        if result.status != "ok":
            continue
        reference = references.setdefault(getattr(result, "framework", "torch"), result)
        result.reference_backend = reference.backend
        if result.final_loss is not None and reference.final_loss is not None:
            result.relative_final_loss = relative_difference(
                float(result.final_loss), float(reference.final_loss)
            )
        if reference is result:
            continue
        for metric in METRICS:
            value, ref = getattr(result, metric), getattr(reference, metric)
            if value is None or ref is None:
                continue
            rel = relative_difference(float(value), float(ref))
            if abs(rel) > tolerance:
                result.divergences.append(
                    Divergence(metric, float(value), float(ref), reference.backend, rel)
                )
        if result.divergences:
            causes = likely_causes(getattr(result, "settings", {}) or {})
            result.divergence_hint = (
                f"likely cause: {'; '.join(causes)}"
                if causes
                else f"usual causes: {GENERIC_CAUSES}"
            )
            flagged.append(result)
    return flagged
