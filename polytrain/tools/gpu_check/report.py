"""The GPU check's report: case results compared with their plain baselines, a table, RESULTS.md.

:func:`build_report` turns the worker's per-case results into the JSON report
(loss check, tokens/s, ratio to the plain loop, MFU, the throughput goal);
:func:`table` prints it; :func:`results_section` renders it as a dated section of
``benchmarks/RESULTS.md`` naming the device, and :func:`append_section` adds that
section at the end of the file, leaving everything before it as it was.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

from polytrain.tools.gpu_check import cases as plan_cases
from polytrain.tools.gpu_check import workload as wl

SCHEMA = 1


def _loss_check(case: plan_cases.Case, out: dict[str, Any], base: dict[str, Any] | None) -> None:
    """Add ``loss_check`` (pass / fail / n/a), ``max_rel_loss_diff``, ``tolerance`` to ``out``."""
    if case.runner == "plain" or out.get("status") != "ok":
        out["loss_check"] = "n/a"
        return
    if base is None or base.get("status") != "ok":
        out["loss_check"] = "n/a"
        out["loss_note"] = f"baseline {case.baseline} did not run"
        return
    tolerance = plan_cases.TOLERANCES[case.precision]
    diffs = wl.relative_differences(out["losses"], base["losses"])
    worst = max(diffs) if diffs else 0.0
    out["tolerance"] = tolerance
    out["max_rel_loss_diff"] = worst
    out["rel_loss_diffs"] = diffs
    base_drop = base["losses"][0] - base["losses"][-1]
    drop = out["losses"][0] - out["losses"][-1]
    trains = base_drop <= 0 or drop >= plan_cases.MIN_TRAINING * base_drop
    out["loss_check"] = "pass" if worst <= tolerance and trains else "fail"
    if worst > tolerance:
        step = diffs.index(worst)
        out["loss_note"] = (
            f"step {step}: loss {out['losses'][step]:.6g} vs plain {base['losses'][step]:.6g} "
            f"(relative {worst:.2e} > {tolerance:g})"
        )
    elif not trains:
        out["loss_note"] = f"loss fell by {drop:.4g} over the check steps, plain by {base_drop:.4g}"


def build_report(
    meta: dict[str, Any], workload: wl.Workload, case_list: list[plan_cases.Case], results: dict
) -> dict[str, Any]:
    """The JSON report.

    Args:
        meta: ``date``, ``device`` (name, kind, peak), ``software`` versions, ``settings``.
        workload: what every case trained.
        case_list: the plan, in run order.
        results: case name -> the worker's result (cases that never ran are absent).
    """
    peak = meta["device"].get("peak_tflops")
    params = meta["model"]["matmul_params"]
    flops_token = wl.flops_per_token(workload, params)
    rows = []
    for case in case_list:
        out = {**case.to_dict(), **results.get(case.name, {"status": "skipped"})}
        if out.get("status") == "ok":
            out["tokens_per_s"] = workload.tokens_per_step / out["step_s"]
            out["mfu"] = wl.mfu(out["tokens_per_s"], flops_token, peak)
        base = results.get(case.baseline)
        _loss_check(case, out, base)
        if case.runner == "polytrain" and out.get("status") == "ok" and base and base.get("step_s"):
            out["ratio"] = base["step_s"] / out["step_s"]
        rows.append(out)
    return {
        "schema": SCHEMA,
        **meta,
        "model": {**meta["model"], "flops_per_token": flops_token},
        "workload": vars(workload),
        "tolerances": dict(plan_cases.TOLERANCES),
        "cases": rows,
        "goals": _goals(rows, meta["device"].get("kind")),
    }


def _goals(rows: list[dict[str, Any]], kind: str | None) -> list[dict[str, Any]]:
    """The throughput goal per goal case at bf16 (a GPU run only)."""
    if kind != "cuda":
        return []
    by_name = {row["name"]: row for row in rows}
    goals = []
    for name in plan_cases.GOAL_CASES:
        row = by_name.get(f"{name}-bf16")
        ratio = row.get("ratio") if row else None
        goals.append(
            {
                "case": f"{name}-bf16",
                "goal": f"tokens/s >= {plan_cases.GOAL_RATIO} x plain",
                "ratio": ratio,
                "met": None if ratio is None else ratio >= plan_cases.GOAL_RATIO,
            }
        )
    return goals


def verdict(report: dict[str, Any]) -> bool:
    """Whether the run passed: every case ran, and every polytrain case's losses match (goals are reported)."""
    return all(
        row.get("status") == "ok" and (row["runner"] == "plain" or row.get("loss_check") == "pass")
        for row in report["cases"]
    )


# ------------------------------------------------------------------------- rendering
def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _check_cell(row: dict[str, Any]) -> str:
    if row.get("loss_check") in (None, "n/a"):
        return "-"
    return (
        f"{row['loss_check']} ({_num(row.get('max_rel_loss_diff'), '.1e')} / {row['tolerance']:g})"
    )


def _status_cell(row: dict[str, Any], compiling: bool) -> str:
    status = row.get("status", "skipped")
    refused = compiling and not row.get("compile") and row["runner"] != "plain"
    return status + (" (no compile)" if refused else "")


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per case: the columns of :data:`COLUMNS`."""
    rows = []
    compiling = bool(report.get("settings", {}).get("compile"))
    for row in report["cases"]:
        mfu = row.get("mfu")
        rows.append(
            [
                row["name"],
                _status_cell(row, compiling),
                _check_cell(row),
                _num(row.get("tokens_per_s"), ",.0f"),
                _num(row.get("ratio"), ".3f"),
                "-" if mfu is None else f"{100 * mfu:.1f} %",
                _num(row.get("peak_mem_gib"), ".2f"),
                _num(row.get("wall_s"), ".0f"),
            ]
        )
    return rows


COLUMNS = [
    "case",
    "status",
    "loss check (max rel. diff / tol.)",
    "tokens/s",
    "x plain",
    "MFU",
    "peak GiB",
    "wall s",
]


def table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table, then the goals and each failure's error."""
    rows = [COLUMNS, *table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += _notes(report)
    return "\n".join(lines)


def _notes(report: dict[str, Any]) -> list[str]:
    notes = []
    for goal in report.get("goals", []):
        met = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        notes.append(f"goal {goal['case']}: {goal['goal']}: {_num(goal['ratio'], '.3f')} ({met})")
    for row in report["cases"]:
        if row.get("error"):
            notes.append(f"{row['name']}: {row['error'].splitlines()[0][:300]}")
        elif row.get("loss_note"):
            notes.append(f"{row['name']}: {row['loss_note']}")
    return notes


def results_section(report: dict[str, Any]) -> str:
    """The report as a dated Markdown section of RESULTS.md, naming the device."""
    device, soft, load = report["device"], report["software"], report["workload"]
    title = (
        f"## GPU check, {report['date'][:10]}: {device['name']} "
        f"(torch {soft.get('torch')}, CUDA {soft.get('cuda') or '-'})"
    )
    body = [
        title,
        "",
        f"`scripts/gpu_check.sh run` ({report['elapsed_s']:.0f} s): {report['model']['name']} "
        f"({report['model']['matmul_params'] / 1e6:.1f}M matmul parameters), batch "
        f"{load['batch']} x {report['model']['seq']} tokens, world size 1 under torchrun "
        f"({device.get('dist_backend')}); {load['check_steps']} steps compared with the plain "
        f"loop, {load['warmup_steps']} warm-up, {load['timed_steps']} timed. Activation "
        f"checkpointing {'on' if report['settings'].get('checkpointing') else 'off'}, "
        f"compile {'on' if report['settings'].get('compile') else 'off'} (FSDP1: refused). "
        f"MFU against {device.get('peak_tflops') or '-'} TFLOP/s (dense bf16), model FLOPs "
        f"{report['model']['flops_per_token'] / 1e9:.3f} GFLOP per token.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(cells) + " |" for cells in table_rows(report)),
        "",
        *(f"- {note}" for note in _notes(report)),
        "",
        "Software: " + ", ".join(f"{k} {v}" for k, v in sorted(soft.items()) if v) + ".",
        "",
    ]
    return "\n".join(body)


def append_section(results_md: Path, report: dict[str, Any]) -> str:
    """Append :func:`results_section` to ``results_md`` (the file before it is left as it was)."""
    section = results_section(report)
    old = results_md.read_text() if results_md.exists() else ""
    separator = "" if not old or old.endswith("\n\n") else ("\n" if old.endswith("\n") else "\n\n")
    with results_md.open("a") as handle:
        handle.write(separator + section)
    return section


def today() -> str:
    """The run's timestamp (UTC, ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
