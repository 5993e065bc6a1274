"""Launching the cases of a suite, interleaved, and saving what every run measured.

One run is one fresh launch of a :class:`~benchmarks.harness.cases.Case`: its
commands start at once, each in its own session, with this repository first on
``PYTHONPATH``; every process writes ``rank<r>.json`` (and a driver ``driver.json``)
into a fresh result directory, which :func:`summarize` reduces to the run's numbers.
:func:`run_sections` runs every case of a group ``reps`` times in turn (A, B, A, B,
...), so that a change in machine load hits both sides alike, and saves each section
to ``benchmarks/out/<section>.json`` as soon as it is done.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.cases import BENCH, ROOT, Case, Command
from benchmarks.harness.tables import fmt
from benchmarks.workloads.mlp import NUM_WORKERS

#: Where the raw results go (git-ignored): ``<section>.json`` and the launch logs.
OUT = BENCH / "out"


def _missing(requires: tuple[str, ...]) -> str | None:
    for module in requires:
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except ModuleNotFoundError:
            return f"{module} is not installed"
    return None


def _commands_for(case: Case, result_dir: Path) -> list[Command]:
    base = case.commands_at_launch() if case.commands_at_launch else case.commands
    return [(argv + ["--result-dir", str(result_dir)], env) for argv, env in base]


def _kill(proc: subprocess.Popen) -> None:
    # Each launch is its own session: its whole process group goes (torchrun's and
    # horovodrun's children, a driver's local Ray instance).
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_case(case: Case, log_dir: Path) -> dict[str, Any]:
    """Launch ``case`` once and return its measurements (or its error)."""
    result_dir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env_base["PYTHONPATH"]] if env_base.get("PYTHONPATH") else [])
    )
    env_base.setdefault("RAY_DEDUP_LOGS", "0")
    log_path = log_dir / (case.key.replace("/", "__") + f".{int(time.time())}.log")
    load_before = os.getloadavg()[0]
    procs = []
    with open(log_path, "w") as log:
        t_launch = time.time()
        for argv, env in _commands_for(case, result_dir):
            procs.append(
                subprocess.Popen(
                    argv,
                    env={**env_base, **env},
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        error = None
        deadline = t_launch + case.timeout_s
        for proc in procs:
            try:
                rc = proc.wait(max(1.0, deadline - time.time()))
                if rc != 0 and error is None:
                    error = f"exit status {rc}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {case.timeout_s:g}s"
                break
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
    wall = time.time() - t_launch
    ranks = []
    for path in sorted(result_dir.glob("rank*.json")):
        ranks.append(json.loads(path.read_text()))
    driver_path = result_dir / "driver.json"
    driver = json.loads(driver_path.read_text()) if driver_path.exists() else None
    shutil.rmtree(result_dir, ignore_errors=True)
    if case.kind == "scenario" and driver is None and error is None:
        error = "the driver wrote no results"
    elif case.kind != "scenario" and len(ranks) < NUM_WORKERS and error is None:
        error = f"only {len(ranks)} of {NUM_WORKERS} workers wrote results"
    if error is not None:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-12:]
        return {"ok": False, "error": error, "log": str(log_path), "log_tail": tail, "wall_s": wall}
    return {
        "ok": True,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "log": str(log_path),
        **(
            summarize_scenario(driver)
            if case.kind == "scenario"
            else summarize(case, t_launch, ranks, driver)
        ),
    }


def _median_after(values: list[float], warmup: int) -> float | None:
    tail = values[warmup:]
    return statistics.median(tail) if tail else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(
    case: Case, t_launch: float, ranks: list[dict[str, Any]], driver: dict[str, Any] | None
) -> dict[str, Any]:
    """Reduce the per-rank records of one run to its numbers."""
    warmup = case.spec.warmup
    first = max(r["marks"].get("first_step", float("nan")) for r in ranks)
    out: dict[str, Any] = {
        "launch_s": first - t_launch,
        # intervals[i] ends at step i + 1; the same steps as step_s[warmup:].
        "step_ms": _mean([_scale(_median_after(r["step_s"], warmup)) for r in ranks]),
        "interval_ms": _mean([_scale(_median_after(r["interval_s"], warmup - 1)) for r in ranks]),
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "delta_rss_mb": [
            r["peak_rss_mb"] - r["baseline_rss_mb"] if r.get("baseline_rss_mb") else None
            for r in ranks
        ],
        # Per rank (rank order): the set-up peak (model built and wrapped, before the first
        # step) and the training peak after it (VmHWM reset in between; None where not reset).
        "baseline_rss_mb": [r.get("baseline_rss_mb") for r in ranks],
        "setup_peak_rss_mb": [r.get("setup_peak_rss_mb") for r in ranks],
        "train_peak_rss_mb": [r.get("train_peak_rss_mb") for r in ranks],
        "niceness": [r["niceness"] for r in ranks],
        "torch_threads": [r["torch_threads"] for r in ranks],
        "python_threads": [r["python_threads"] for r in ranks],
        "steps": [len(r["step_s"]) for r in ranks],
    }
    phases: dict[str, float] = {}
    if driver is not None:
        marks = driver["marks"]
        phases = {f"driver_{k}": v - t_launch for k, v in marks.items()}
        if "ray_init_done" in marks:
            out["ray_init_s"] = marks["ray_init_done"] - marks["imported"]
            out["launch_excl_ray_init_s"] = out["launch_s"] - out["ray_init_s"]
    for name in (
        "script_start",
        "imported",
        "process_group",
        "loop_start",
        "model_build",
        "wrapped",
    ):
        values = [r["marks"][name] for r in ranks if name in r["marks"]]
        if values:
            phases[f"worker_{name}"] = max(values) - t_launch
    out["phases_s"] = phases
    return out


def _scale(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize_scenario(driver: dict[str, Any] | None) -> dict[str, Any]:
    """The numbers of a scenario run: its driver's ``metrics``."""
    return {"metrics": (driver or {}).get("metrics", {})}


def run_sections(
    sections: dict[str, list[list[Case]]],
    tags: set[str],
    reps: int,
    run_id: str,
    command: str,
    out_dir: Path = OUT,
) -> dict[str, dict[str, Any]]:
    """Run every selected case ``reps`` times, interleaved within its group.

    Each section's results go to ``out_dir/<section>.json`` as soon as it is done.
    """
    log_dir = OUT / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, groups in sections.items():
        cases = [c for group in groups for c in group if c.tag in tags]
        if not cases:
            continue
        section: dict[str, Any] = {}
        results[name] = section
        load_start = os.getloadavg()
        for group in groups:
            selected = [c for c in group if c.tag in tags]
            for case in selected:
                section[case.key] = {
                    "label": case.label,
                    "tag": case.tag,
                    "kind": case.kind,
                    "baseline": case.baseline,
                    "spec": dataclasses.asdict(case.spec),
                    "run_id": run_id,
                    "runs": [],
                }
                reason = _missing(case.requires)
                if reason:
                    section[case.key]["skipped"] = reason
            for rep in range(reps):
                for case in selected:
                    entry = section[case.key]
                    if entry.get("skipped"):
                        continue
                    print(f"[{name}] rep {rep + 1}/{reps}: {case.key} ...", flush=True)
                    result = run_case(case, log_dir)
                    entry["runs"].append(result)
                    _report_run(case, entry, result)
        meta = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_start": load_start,
            "load_end": os.getloadavg(),
            "command": command,
        }
        for key in section:
            section[key]["meta"] = meta
        save_section(name, section, command, out_dir)  # an interrupted run keeps what it finished
    return results


def _report_run(case: Case, entry: dict[str, Any], result: dict[str, Any]) -> None:
    if result["ok"] and case.kind == "scenario":
        print(f"    {result['metrics']}  load {result['load_before']:.1f}", flush=True)
    elif result["ok"]:
        print(
            f"    launch {result['launch_s']:.1f}s  step "
            f"{fmt(result['step_ms'], 2)} ms  interval "
            f"{fmt(result['interval_ms'], 2)} ms  load {result['load_before']:.1f}",
            flush=True,
        )
    else:
        # A failing backend must not stop the others; its later reps are skipped.
        entry["skipped"] = f"failed: {result['error']} (log: {result['log']})"
        print(
            f"    {entry['skipped']}\n      " + "\n      ".join(result["log_tail"]),
            flush=True,
        )


def save_section(name: str, cases: dict[str, Any], command: str, out_dir: Path = OUT) -> None:
    """Merge ``cases`` into ``out/<name>.json``; cases not run this time keep their last results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    previous = json.loads(path.read_text())["cases"] if path.exists() else {}
    previous.update(cases)
    path.write_text(json.dumps({"command": command, "cases": previous}, indent=1))


def load_saved(out_dir: Path = OUT) -> dict[str, dict[str, Any]]:
    """The latest saved results of every section (``benchmarks/out/<section>.json``)."""
    saved = {}
    for path in sorted(out_dir.glob("*.json")):
        try:
            saved[path.stem] = json.loads(path.read_text())["cases"]
        except (json.JSONDecodeError, KeyError):
            continue
    return saved
