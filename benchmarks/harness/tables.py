"""The numbers of saved runs as table cells: medians per case, ratios, goals, the launch/step table.

Every suite that writes RESULTS.md renders its sections with these, from the saved
results of :mod:`benchmarks.harness.runner` (a section: ``{case key: entry}``, an
entry holding the case's label, baseline and runs).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from typing import Any


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or "n/a"."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def aggregate(entry: dict[str, Any]) -> dict[str, Any]:
    """Medians over the successful repetitions of one case."""
    runs = [r for r in entry.get("runs", []) if r.get("ok")]
    agg: dict[str, Any] = {"n": len(runs)}
    for key in ("launch_s", "ray_init_s", "launch_excl_ray_init_s", "step_ms", "interval_ms"):
        values = [r[key] for r in runs if r.get(key) is not None]
        agg[key] = statistics.median(values) if values else None
    for key in ("peak_rss_mb", "delta_rss_mb"):
        values = [max(v for v in r[key] if v is not None) for r in runs if any(r[key])]
        agg[key] = statistics.median(values) if values else None
    agg["niceness"] = sorted({n for r in runs for n in r["niceness"]})
    agg["torch_threads"] = sorted({t for r in runs for t in r["torch_threads"] if t is not None})
    loads = [r["load_before"] for r in runs]
    agg["load"] = (min(loads), max(loads)) if loads else None
    return agg


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def goal(value: float | None, limit: float) -> str:
    """``value`` against its goal ``<= limit``: "1.020 (met, goal <= 1.03)"."""
    if value is None:
        return "n/a"
    return f"{value:.3f} ({'met' if value <= limit else 'missed'}, goal <= {limit:g})"


def skip_note(entry: dict[str, Any]) -> str:
    """Why a case has no numbers ("skipped: ..."), or "" when it has some."""
    return (
        f"skipped: {entry['skipped']}" if entry.get("skipped") and not aggregate(entry)["n"] else ""
    )


def meta_line(section: dict[str, Any]) -> str:
    """When, where, under which load and with which command ``section`` was measured."""
    metas = {json.dumps(e.get("meta"), sort_keys=True) for e in section.values() if e.get("meta")}
    lines = []
    for text in sorted(metas):
        meta = json.loads(text)
        load_s = ", ".join(f"{x:.1f}" for x in meta["load_start"])
        load_e = ", ".join(f"{x:.1f}" for x in meta["load_end"])
        lines.append(
            f"_Measured {meta['date']} on {platform.node() or 'this machine'} "
            f"({os.cpu_count()} CPU cores, no GPU); load average (1, 5, 15 min) {load_s} at the "
            f"start, {load_e} at the end. Command: `{meta.get('command', '?')}`._"
        )
    return "\n".join(lines)


def render_time_table(
    section: dict[str, Any], keys: list[str], interval_only: bool = False
) -> list[str]:
    """Launch and step-time rows for ``keys`` (each against its baseline).

    ``interval_only``: the runners measure only the step-to-step interval (Keras,
    where a callback sees batch ends, and the native script's begin-to-end time
    would not compare with anything on the polytrain side); the step columns say n/a.
    """
    lines = [
        "| Runner | Launch to 1st step (s) | ray.init (s) | Launch excl. ray.init (s) "
        "| Step (ms) | Step interval (ms) | Step ratio | Interval ratio | Launch ratio (incl. / excl. ray.init) "
        "| Worker nice / threads | Reps | Load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        entry = section.get(key)
        if entry is None:
            continue
        skipped = skip_note(entry)
        if skipped:
            lines.append(f"| {entry['label']} | {skipped} |||||||||||")
            continue
        agg = aggregate(entry)
        base = aggregate(section[entry["baseline"]]) if entry.get("baseline") in section else None
        step_r = interval_r = launch_r = launch_x = None
        if base:
            step_r = ratio(agg["step_ms"], base["step_ms"])
            interval_r = ratio(agg["interval_ms"], base["interval_ms"])
            launch_r = ratio(agg["launch_s"], base["launch_s"])
            launch_x = ratio(agg["launch_excl_ray_init_s"], base["launch_s"])
        load = agg["load"]
        step_text = "n/a" if interval_only else fmt(agg["step_ms"], 2)
        step_r_text = "n/a" if interval_only else fmt(step_r, 3)
        lines.append(
            f"| {entry['label']} | {fmt(agg['launch_s'])} | {fmt(agg['ray_init_s'])} "
            f"| {fmt(agg['launch_excl_ray_init_s'])} | {step_text} "
            f"| {fmt(agg['interval_ms'], 2)} | {step_r_text if base else 'baseline'} "
            f"| {fmt(interval_r, 3) if base else ''} "
            f"| {(fmt(launch_r, 2) + ' / ' + fmt(launch_x, 2)) if base else ''} "
            f"| {agg['niceness']} / {agg['torch_threads']} | {agg['n']} "
            f"| {f'{load[0]:.1f}-{load[1]:.1f}' if load else 'n/a'} |"
        )
    return lines
