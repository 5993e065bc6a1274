"""A backend comparison's results: per-backend records, a text table, CSV, JSON, a plot.

:func:`polytrain.compare.runner.compare_backends` fills the records; this module only
presents them, so it imports nothing of the training side.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polytrain.compare.divergence import Divergence

__all__ = [
    "CSV_COLUMNS",
    "FAILED",
    "OK",
    "SKIPPED",
    "BackendResult",
    "format_table",
    "write_results",
]

OK, SKIPPED, FAILED = "ok", "skipped", "failed"

CSV_COLUMNS = (
    "backend",
    "framework",
    "status",
    "epochs",
    "epoch_time_s",
    "samples_per_s",
    "tokens_per_s",
    "final_loss",
    "grad_norm",
    "val_loss",
    "val_accuracy",
    "peak_memory_mb",
    "startup_s",
    "losses",
    "diverges",
    "divergence",
    "reason",
)


@dataclass
class BackendResult:
    """What one backend did on the comparison job.

    Attributes:
        backend: the backend name as requested.
        status: "ok", "skipped" (not installed) or "failed" (raised; see ``reason``).
        reason: why it was skipped or failed (with the install command where one helps).
        losses: mean training loss of each epoch.
        epoch_times_s: wall time of each epoch (slowest worker).
        samples_per_s: throughput of each epoch, all workers together.
        tokens_per_s: tokens of each epoch per second (token batches only, else empty).
        grad_norms: the gradient norm of each epoch's last step (``max_grad_norm`` runs).
        val_loss: validation loss after the last epoch (None without validation data).
        val_accuracy: validation accuracy after the last epoch.
        peak_memory_mb: the largest peak memory of one worker over all epochs.
        startup_s: seconds to start the workers and build the model on them.
        framework: "torch" or "tensorflow".
        settings: the settings that can change results (``use_fp16``, the backend's
            options as dotted keys), for the divergence check.
        reference_backend: the backend this one's results are compared with.
        relative_final_loss: the final loss relative to the reference's.
        divergences: the metrics that differ from the reference's beyond the tolerance.
        divergence_hint: which setting usually causes it.
    """

    backend: str
    status: str = OK
    reason: str = ""
    losses: list[float] = field(default_factory=list)
    epoch_times_s: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    val_accuracy: float | None = None
    peak_memory_mb: float | None = None
    startup_s: float | None = None
    framework: str = "torch"
    settings: dict[str, Any] = field(default_factory=dict)
    reference_backend: str | None = None
    relative_final_loss: float | None = None
    divergences: list[Divergence] = field(default_factory=list)
    divergence_hint: str = ""

    @property
    def diverges(self) -> bool:
        """Whether a metric differs from the reference backend's beyond the tolerance."""
        return bool(self.divergences)

    def divergence_note(self) -> str:
        """What differs and the likely cause ("" when nothing does)."""
        if not self.divergences:
            return ""
        what = "; ".join(d.describe() for d in self.divergences)
        return f"{what}. {self.divergence_hint}"

    def vs_reference(self) -> str:
        """The final loss relative to the reference backend's: "ref", "+0.0%", "+4.9% !"."""
        if self.reference_backend is None or self.relative_final_loss is None:
            return "-"
        if self.reference_backend == self.backend:
            return "ref"
        rel = self.relative_final_loss
        text = f"{rel:+.1%}" if math.isfinite(rel) else "n/a"
        return f"{text} !" if self.diverges else text

    @property
    def epochs(self) -> int:
        """Epochs completed."""
        return len(self.losses)

    @property
    def final_loss(self) -> float | None:
        """Training loss of the last epoch."""
        return self.losses[-1] if self.losses else None

    @property
    def epoch_time_s(self) -> float | None:
        """Steady-state epoch time: the mean over the epochs after the first, when there are several.

        The first epoch also pays one-off costs (lazy imports, allocator warm-up,
        DeepSpeed's extension build) that say little about the backend's speed.
        """
        times = self.epoch_times_s[1:] or self.epoch_times_s
        return statistics.fmean(times) if times else None

    @property
    def throughput(self) -> float | None:
        """Steady-state samples/s, over the same epochs as :attr:`epoch_time_s`."""
        rates = self.samples_per_s[1:] or self.samples_per_s
        return statistics.fmean(rates) if rates else None

    @property
    def token_throughput(self) -> float | None:
        """Steady-state tokens/s (None for batches without tokens)."""
        rates = self.tokens_per_s[1:] or self.tokens_per_s
        return statistics.fmean(rates) if rates else None

    @property
    def grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (None without ``max_grad_norm``)."""
        return self.grad_norms[-1] if self.grad_norms else None

    def row(self) -> dict[str, Any]:
        """One CSV row (see :data:`CSV_COLUMNS`)."""
        return {
            "backend": self.backend,
            "framework": self.framework,
            "status": self.status,
            "epochs": self.epochs,
            "epoch_time_s": _round(self.epoch_time_s, 4),
            "samples_per_s": _round(self.throughput, 1),
            "tokens_per_s": _round(self.token_throughput, 1),
            "final_loss": _round(self.final_loss, 5),
            "grad_norm": _round(self.grad_norm, 5),
            "val_loss": _round(self.val_loss, 5),
            "val_accuracy": _round(self.val_accuracy, 4),
            "peak_memory_mb": _round(self.peak_memory_mb, 1),
            "startup_s": _round(self.startup_s, 2),
            "losses": ";".join(f"{x:.5f}" for x in self.losses),
            "diverges": self.diverges,
            "divergence": self.divergence_note(),
            "reason": self.reason,
        }


def _round(value: float | None, digits: int) -> float | str:
    return "" if value is None else round(float(value), digits)


def format_table(results: Sequence[BackendResult]) -> str:
    """The results as an aligned text table (one row per backend).

    The ``vs ref`` column gives each backend's final loss relative to its
    framework's reference backend; ``!`` marks a backend whose results differ beyond
    the tolerance, explained in a line under the table. Language-model runs add
    ``tokens/s`` and ``grad norm`` (the last step's, with ``max_grad_norm``) where a
    backend reported them.
    """
    headers: tuple[str, ...] = (
        "backend",
        "status",
        "epoch time (s)",
        "samples/s",
        "final loss",
        "val accuracy",
        "peak MB/worker",
        "framework",
        "vs ref",
        "note",
    )

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None or math.isnan(value) else format(value, spec)

    rows = [
        (
            r.backend,
            r.status,
            fmt(r.epoch_time_s, ".3f"),
            fmt(r.throughput, ".0f"),
            fmt(r.final_loss, ".4f"),
            fmt(r.val_accuracy, ".3f"),
            fmt(r.peak_memory_mb, ".0f"),
            r.framework,
            r.vs_reference(),
            r.reason,
        )
        for r in results
    ]
    headers, rows = _with_token_columns(headers, rows, results, fmt)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    widths[-1] = 0  # the note is last and free-length
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * max(w, len(h)) for h, w in zip(headers, widths, strict=True)))
    lines += [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines += [f"! {r.backend}: {r.divergence_note()}" for r in results if r.diverges]
    return "\n".join(lines)


def _with_token_columns(
    headers: tuple[str, ...],
    rows: list[tuple[Any, ...]],
    results: Sequence[BackendResult],
    fmt: Callable[[float | None, str], str],
) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """Insert ``tokens/s`` and ``grad norm`` after ``samples/s`` when any backend has them."""
    extra = [
        (name, attr, spec)
        for name, attr, spec in (
            ("tokens/s", "token_throughput", ".0f"),
            ("grad norm", "grad_norm", ".4f"),
        )
        if any(getattr(r, attr) is not None for r in results)
    ]
    if not extra:
        return headers, rows
    at = headers.index("samples/s") + 1
    headers = headers[:at] + tuple(name for name, _, _ in extra) + headers[at:]
    rows = [
        row[:at] + tuple(fmt(getattr(r, attr), spec) for _, attr, spec in extra) + row[at:]
        for row, r in zip(rows, results, strict=True)
    ]
    return headers, rows


def write_results(results: Sequence[BackendResult], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``compare.csv``, ``results.json`` and ``compare.png`` into ``out_dir``.

    Returns:
        ``{"csv": path, "json": path, "png": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "compare.csv", "json": out / "results.json", "png": out / "compare.png"}
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(r.row() for r in results)
    payload = [
        {**asdict(r), "epoch_time_s": r.epoch_time_s, "throughput": r.throughput} for r in results
    ]
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    _plot(results, paths["png"])
    return paths


def _plot(results: Sequence[BackendResult], path: Path) -> None:
    # The object-oriented API with the Agg canvas: no pyplot, so the caller's
    # matplotlib backend (a notebook's, say) is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, bar_ax = fig.subplots(1, 2)
    ran = [r for r in results if r.losses]
    for r in ran:
        loss_ax.plot(range(1, r.epochs + 1), r.losses, marker="o", label=r.backend)
    loss_ax.set(title="Training loss per epoch", xlabel="epoch", ylabel="loss")
    if ran:
        loss_ax.legend()
        loss_ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        loss_ax.text(0.5, 0.5, "no backend ran", ha="center", va="center")
    names = [r.backend for r in results]
    # A language model's throughput is in tokens (sequences differ in length).
    tokens = any(r.token_throughput is not None for r in results)
    rate_of = (lambda r: r.token_throughput) if tokens else (lambda r: r.throughput)
    rates = [rate_of(r) or 0.0 for r in results]
    bars = bar_ax.bar(
        names, rates, color=["tab:blue" if r.status == OK else "tab:gray" for r in results]
    )
    for bar, r in zip(bars, results, strict=True):
        label = f"{rate_of(r):.0f}" if r.status == OK and rate_of(r) else r.status
        bar_ax.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    bar_ax.set(title="Throughput (steady state)", ylabel="tokens/s" if tokens else "samples/s")
    fig.savefig(path, dpi=110)
