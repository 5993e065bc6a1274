"""The chaos run's report: its Markdown tables, and the chaos section of RELIABILITY.md."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.chaos.schedule import KINDS


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown tables: per case, and per fault kind."""
    lines = [
        f"Seed {args.seed}, {args.faults} faults per backend, kinds: {args.kinds or ', '.join(KINDS)}; "
        f"every_n_steps={args.every_n_steps}, step sleep {args.step_sleep_s} s, drain deadline "
        f"{args.drain_deadline_s} s.",
        "",
        "| backend | faults survived | steps lost (designed max) | time lost (s) | final weights vs uninterrupted | "
        "leaked actors / PGs | worker processes left | stray files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        chaos = r.get("chaos", {})
        faults = [f for f in chaos.get("faults", []) if f.get("injected")]
        survived = sum(1 for f in faults if f.get("survived"))
        lost = sum(f.get("steps_lost", 0) for f in faults)
        designed = sum(f.get("designed_max", 0) for f in faults)
        w = r.get("weights", {})
        weights = (
            ("bit-equal" if w.get("bit_equal") else f"max diff {w.get('max_abs_diff'):.3g}")
            if w.get("compared")
            else "not compared"
        )
        left = r.get("leftovers", {})
        lines.append(
            f"| {r['case']} | {survived} / {len(r['schedule'])} | {lost} ({designed}) | "
            f"{sum(f.get('time_lost_s', 0) for f in faults):.0f} (wall {r.get('time_lost_s', '?')}) | "
            f"{weights} | {len(left.get('actors', []))} / {len(left.get('placement_groups', []))} | "
            f"{len(r.get('processes_left', []))} | {len(r.get('stray_files', []))} |"
        )
    lines += [
        "",
        "| backend | fault kind | faults | steps lost per fault (designed max) | time lost per fault, mean (s) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        faults = [f for f in r.get("chaos", {}).get("faults", []) if f.get("injected")]
        for kind in KINDS:
            of_kind = [f for f in faults if f["kind"] == kind]
            if not of_kind:
                continue
            lost = ", ".join(str(f.get("steps_lost", "?")) for f in of_kind)
            mean = statistics.mean(f.get("time_lost_s", 0.0) for f in of_kind)
            lines.append(
                f"| {r['case']} | {kind} | {len(of_kind)} | {lost} ({of_kind[0].get('designed_max')}) | {mean:.1f} |"
            )
    failed = [(r["case"], k) for r in results for k, ok in r["checks"].items() if not ok]
    lines += ["", "Failed checks: " + (", ".join(f"{c}: {k}" for c, k in failed) or "none") + "."]
    return "\n".join(lines) + "\n"


SECTION = "## Chaos run"


DEFINITIONS = """\
Each backend trains the same run twice on a simulated cluster (`ray.cluster_utils.Cluster`:
a CPU-less head, two 2-CPU worker nodes at a time on loopback addresses, 2 workers SPREAD,
`checkpoint_dir` with `resume=True`, torch `every_n_steps` as below, SGD with momentum, a
model with dropout for torch): once uninterrupted, once under the seeded fault schedule
(the same for every backend), each run a sequence of driver processes. Lost and drained
nodes are replaced at once by a fresh node, as an autoscaler would; a drained node still
up at its deadline is killed then.

- *faults survived*: training went on after the fault and the run completed.
- *steps lost*: steps trained a second time (rank 0 logs every step it completes), per
  fault. Designed: torch, at most `every_n_steps` for a worker SIGKILL, a frozen worker
  (SIGSTOP, caught by the hang watchdog) and a node removal, 0 for the announced faults
  (drains with and without a deadline, driver SIGTERM). TFTrainer's calls are whole
  epochs, checkpointed at their ends: up to an epoch (8 steps) for the unannounced faults,
  0 for the announced ones (it leaves a draining node when the running epoch ends, well
  before the deadline here, and stops there on SIGTERM).
- *time lost*: per fault, the wall time of its window (until the next fault) beyond what
  the window's new steps take at the reference run's pace; *wall*: the chaos run's wall
  time minus the reference's (driver restarts included).
- *final weights*: the chaos run's final model against the uninterrupted run's.
- *leaked actors / PGs*: actors not dead and placement groups not removed in the cluster
  once the last driver is gone; *worker processes left*: worker pids still running;
  *stray files*: anything in `checkpoint_dir` but committed checkpoints within
  `num_to_keep`, and partial files.
"""


def update_reliability(path: Path, text: str, command: str) -> None:
    """Replace (or append) the chaos section of RELIABILITY.md with this run's tables."""
    import datetime
    import platform

    section = (
        f"{SECTION}\n\nWritten by `{command}` on {datetime.date.today()}, {platform.machine()} "
        f"({os.cpu_count()} CPU cores); regenerated by `make chaos` (the method: "
        f"benchmarks/chaos/).\n\n{DEFINITIONS}\n{text}"
    )
    old = path.read_text() if path.exists() else ""
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + section + (old[end + 1 :] if end >= 0 else "")
    path.write_text(new)
