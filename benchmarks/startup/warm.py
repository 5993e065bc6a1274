"""RESULTS.md section 5 (``--only warm`` of the side-by-side suite): the cold path phase by phase, and warm workers.

Two interleaving groups:

1. Cold launch: ``torchrun`` + the DDP script against polytrain's DDP driver
   (with and without pre-imports), each a fresh process with its own
   ``ray.init``. The driver marks every phase of the trainer's start (see
   ``drivers/polytrain_torch.py``), so the launch is broken down per phase.
2. Warm scenarios (``drivers/polytrain_warm.py``), each in one fresh driver
   process: a second and third trainer after a first one; ``fit`` then ``test`` on
   ``RayStrategy``; ``polytrain compare`` over the torch backends with the pool on
   and off; three Tune trials with ``reuse_actors`` on and off.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from benchmarks.harness.cases import Case, python_command, torch_cases
from benchmarks.harness.tables import fmt, meta_line
from benchmarks.workloads.mlp import WorkloadSpec

#: The section's name in the suite's ``--only`` and in ``benchmarks/out/<name>.json``.
SECTION = "warm"

#: (scenario, label, extra arguments, requirements) of the warm group.
SCENARIOS = (
    ("second", "second/third TorchTrainer, ddp", ["--backend", "ddp"], ()),
    ("second", "second/third TorchTrainer, horovod", ["--backend", "horovod"], ("horovod",)),
    ("resize", "another world size, ddp: 1 -> 2 -> 1", ["--backend", "ddp"], ()),
    ("lightning", "pl.Trainer fit then test, RayStrategy", [], ("pytorch_lightning",)),
    ("compare", "polytrain compare, warm pool", [], ()),
    ("compare", "polytrain compare, pool off", ["--pool", "off"], ()),
    ("tune", "3 Tune trials, reuse_actors=True", ["--reuse-actors"], ("ray.tune",)),
    ("tune", "3 Tune trials, reuse_actors=False", [], ("ray.tune",)),
)


def groups(steps: int) -> list[list[Case]]:
    """The section's interleaving groups for a run of ``steps`` steps per trainer."""
    spec = WorkloadSpec(model="mlp", steps=steps, warmup=min(20, steps // 2))
    cold = torch_cases("ddp", spec, "warm")
    cold[1].label = 'polytrain TorchTrainer(backend="ddp"), workers pre-import torch (default)'
    preload = torch_cases("ddp", spec, "warm")[1]
    preload.key = "warm/polytrain-ddp-no-preload"
    preload.label = 'polytrain TorchTrainer(backend="ddp"), pre-imports off'
    preload.commands = [(argv + ["--preload", "none"], env) for argv, env in preload.commands]
    scenarios = []
    for scenario, label, extra, requires in SCENARIOS:
        key = "warm/" + "-".join([scenario, *(a.strip("-") for a in extra)])
        argv = python_command(
            "drivers/polytrain_warm.py", "--scenario", scenario, "--spec", spec.to_json()
        )
        scenarios.append(
            Case(key, label, "warm", "scenario", [(argv + extra, {})], spec, requires, 600.0)
        )
    for case in (*cold, preload):
        case.tag = "warm"
    return [cold + [preload], scenarios]


# ------------------------------------------------------------------ reporting
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _runs(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in entry.get("runs", []) if r.get("ok")]


#: Cold-path phases: (label, start mark, end mark) over the driver's phase marks.
PHASES = (
    ("interpreter start + driver imports (torch, polytrain)", None, "driver_imported"),
    ("ray.init (local instance)", "driver_imported", "driver_ray_init_done"),
    ("trainer options, backend", "driver_trainer_start", "driver_group_start"),
    ("placement group ready", "driver_group_start", "driver_group_placed"),
    ("actors started (process + metadata)", "driver_group_placed", "driver_group_actors_ready"),
    ("rendezvous (workers import torch here)", "driver_group_ready", "driver_rendezvous_done"),
    (
        "creators + wrapping (DDP imports torch._dynamo)",
        "driver_rendezvous_done",
        "driver_setup_done",
    ),
    ("train() to the end of the first step", "driver_trainer_ready", "first_step"),
)


def _phase(run: dict[str, Any], start: str | None, end: str) -> float | None:
    phases = {**run.get("phases_s", {}), "first_step": run.get("launch_s")}
    if end not in phases or (start is not None and start not in phases):
        return None
    return phases[end] - (phases[start] if start else 0.0)


def render_cold(section: dict[str, Any]) -> list[str]:
    """The cold launch per phase, polytrain with and without pre-imports, against torchrun."""
    keys = ["warm/polytrain-ddp", "warm/polytrain-ddp-no-preload"]
    present = [k for k in keys if k in section and _runs(section[k])]
    native = _runs(section.get("warm/native-ddp", {}))
    if not present or not native:
        return []
    lines = [
        "| Phase (s, median) | " + " | ".join(section[k]["label"] for k in present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for label, start, end in PHASES:
        values = [
            _median([v for r in _runs(section[k]) if (v := _phase(r, start, end)) is not None])
            for k in present
        ]
        lines.append(f"| {label} | " + " | ".join(fmt(v, 2) for v in values) + " |")
    native_launch = _median([r["launch_s"] for r in native])
    for name, key in (
        ("launch to 1st step", "launch_s"),
        ("excl. ray.init", "launch_excl_ray_init_s"),
    ):
        values = [
            _median([r[key] for r in _runs(section[k]) if r.get(key) is not None]) for k in present
        ]
        ratios = [
            f"{fmt(v, 2)} ({fmt(v / native_launch if v and native_launch else None, 2)}x torchrun)"
            for v in values
        ]
        lines.append(f"| **{name}** | " + " | ".join(ratios) + " |")
    lines.append(
        f"| torchrun + DDP script, launch to 1st step | {fmt(native_launch, 2)} |"
        + " |" * (len(present) - 1)
    )
    return lines + [""]


#: Warm rows: (case key, metric, label, goal or None).
WARM_ROWS = (
    (
        "warm/second-backend-ddp",
        "second_first_step_s",
        "2nd trainer (ddp): call to end of 1st step",
        1.0,
    ),
    ("warm/second-backend-ddp", "second_group_s", "  of which: taking the pooled workers", None),
    (
        "warm/second-backend-ddp",
        "second_rendezvous_s",
        "  of which: gloo process group on warm workers",
        None,
    ),
    ("warm/second-backend-ddp", "second_setup_s", "  of which: creators + DDP wrap", None),
    (
        "warm/second-backend-ddp",
        "third_first_step_s",
        "3rd trainer (ddp): call to end of 1st step",
        1.0,
    ),
    ("warm/second-backend-ddp", "cold_first_step_s", "1st trainer (ddp, cold, Ray running)", None),
    (
        "warm/second-backend-horovod",
        "second_first_step_s",
        "2nd trainer (horovod): call to end of 1st step",
        1.0,
    ),
    (
        "warm/second-backend-horovod",
        "second_rendezvous_s",
        "  of which: hvd.init on warm workers",
        None,
    ),
    ("warm/resize-backend-ddp", "cold1_first_step_s", "1 worker (ddp, cold, Ray running)", None),
    (
        "warm/resize-backend-ddp",
        "grow_first_step_s",
        "2 workers on the 1 warm + 1 new: call to end of 1st step",
        None,
    ),
    (
        "warm/resize-backend-ddp",
        "shrink_first_step_s",
        "1 worker on the first of those 2 warm: call to end of 1st step",
        1.0,
    ),
    ("warm/lightning", "test_overhead_s", "trainer.test after fit: call to 1st test batch", 1.0),
    ("warm/lightning", "fit_overhead_s", "trainer.fit (cold): call to 1st train batch", None),
    (
        "warm/compare",
        "overhead_per_backend_s",
        "compare, 5 torch backends: (wall - training) / backend",
        1.5,
    ),
    (
        "warm/compare",
        "overhead_excl_report_per_backend_s",
        "  the same without writing the report (CSV, JSON, PNG plot)",
        None,
    ),
    (
        "warm/compare-pool-off",
        "overhead_per_backend_s",
        "  the same with POLYTRAIN_WARM_POOL=0",
        None,
    ),
    (
        "warm/tune-reuse-actors",
        "later_trial_startup_s",
        "Tune trials 2-3, reuse_actors=True: start-up per trial",
        None,
    ),
    (
        "warm/tune",
        "later_trial_startup_s",
        "Tune trials 2-3, reuse_actors=False: start-up per trial",
        None,
    ),
)


def _metric(run: dict[str, Any], name: str) -> float | None:
    metrics = run.get("metrics", {})
    if name == "later_trial_startup_s":
        later = metrics.get("trial_startup_s", [])[1:]
        return statistics.median(later) if later else None
    value = metrics.get(name)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def render_warm(section: dict[str, Any]) -> list[str]:
    """One row per warm metric: its median over the repetitions, and the goal."""
    lines = ["| Scenario | Median (s) | Runs (s) | Goal | Reps |", "|---|---|---|---|---|"]
    for key, metric, label, goal in WARM_ROWS:
        entry = section.get(key)
        if entry is None:
            continue
        if entry.get("skipped") and not _runs(entry):
            lines.append(f"| {label} | skipped: {entry['skipped']} | | | |")
            continue
        values = [v for r in _runs(entry) if (v := _metric(r, metric)) is not None]
        median = _median(values)
        verdict = (
            ""
            if goal is None or median is None
            else f"<= {goal:g}: {'met' if median <= goal else 'missed'}"
        )
        runs = ", ".join(fmt(v, 2) for v in values)
        lines.append(f"| {label} | {fmt(median, 2)} | {runs} | {verdict} | {len(values)} |")
    reused = _reuse_checks(section)
    return lines + ["", reused, ""] if reused else lines + [""]


def _reuse_checks(section: dict[str, Any]) -> str:
    checks = []
    for key, what in (
        ("warm/second-backend-ddp", "2nd/3rd ddp trainer on the 1st's workers"),
        ("warm/resize-backend-ddp", "1 -> 2 -> 1 workers kept their warm workers"),
        ("warm/lightning", "test on fit's workers"),
        ("warm/tune-reuse-actors", "Tune trials kept their workers (of 2)"),
    ):
        runs = _runs(section.get(key, {}))
        if runs:
            values = [
                r["metrics"].get("same_workers", r["metrics"].get("workers_kept")) for r in runs
            ]
            checks.append(f"{what}: {values}")
    return ("Reuse checks per run: " + "; ".join(checks) + ".") if checks else ""


def render(all_results: dict[str, dict[str, Any]]) -> list[str]:
    """The generated ``### 5.`` section, if measured."""
    section = all_results.get(SECTION)
    if not section:
        return []
    out = [
        "### 5. Start-up: the cold path per phase, and warm workers (issue 14)",
        "",
        meta_line(section),
        "",
    ]
    loads = [r["load_before"] for e in section.values() for r in _runs(e) if "load_before" in r]
    if loads and max(loads) > (os.cpu_count() or 1):
        out += [
            f"_The machine was busy (1-minute load average up to {max(loads):.1f} on "
            f"{os.cpu_count()} cores before a run): these figures hold other work; re-run "
            f"`--only warm` on a quiet machine before quoting them._",
            "",
        ]
    out += ["#### Cold launch (fresh driver process, local Ray started by the driver)", ""]
    out += render_cold(section)
    out += ["#### Warm workers (one driver process per scenario; Ray already running)", ""]
    out += render_warm(section)
    return out
