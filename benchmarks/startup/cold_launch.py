"""Cold launch against torchrun, with a fresh ``ray.init`` taken apart phase by phase.

Interleaves, per repetition: ``torchrun`` + the DDP script, polytrain's DDP driver in a
fresh process (which starts its own local Ray), and a bare ``ray.init`` whose phases are
timed (``drivers/ray_start_profile.py``). Prints a markdown table of the medians and
writes the runs to ``benchmarks/out/cold-launch.json``.

Usage: python benchmarks/run.py cold-launch [--reps 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import runner
from benchmarks.harness.cases import ROOT, torch_cases
from benchmarks.workloads.mlp import WorkloadSpec

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "cold-launch"
OUT = runner.OUT / "cold-launch.json"
PROFILE = [sys.executable, str(ROOT / "benchmarks" / "drivers" / "ray_start_profile.py")]


def _env() -> dict[str, str]:
    # A `benchmarks` package in site-packages would shadow this repository's.
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _first_step(argv: list[str]) -> tuple[float, dict[str, Any]]:
    """Launch to the slowest rank's first step (s), and the driver's marks if any."""
    result_dir = Path(tempfile.mkdtemp(prefix="polytrain-cold-"))
    try:
        start = time.time()
        subprocess.run(
            argv + ["--result-dir", str(result_dir)],
            env=_env(),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=300,
        )
        ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
        first = max(r["marks"]["first_step"] for r in ranks)
        driver = result_dir / "driver.json"
        marks = json.loads(driver.read_text())["marks"] if driver.exists() else {}
        return first - start, {k: v - start for k, v in marks.items() if isinstance(v, float)}
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)


def _ray_phases() -> dict[str, Any]:
    out = subprocess.run(PROFILE, env=_env(), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved repetitions and print the table."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    spec = WorkloadSpec(model="mlp", steps=args.steps, warmup=min(10, args.steps // 2))
    native, polytrain = (c.commands[0][0] for c in torch_cases("ddp", spec, "cold"))
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        load = os.getloadavg()[0]
        torchrun_s, _ = _first_step(native)
        polytrain_s, marks = _first_step(polytrain)
        phases = _ray_phases()
        runs.append(
            {
                "rep": rep,
                "load_1min": load,
                "torchrun_s": torchrun_s,
                "polytrain_s": polytrain_s,
                "polytrain_marks": marks,
                "ray_start": phases,
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs}, indent=1)
    )
    print("\n".join(table(runs)))
    return 0


def table(runs: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the medians of the launch and of the phases of ``ray.init``."""
    med = statistics.median
    torchrun = med(r["torchrun_s"] for r in runs)
    lines = [
        "| Phase (s, median) | value | share of torchrun's launch |",
        "|---|---|---|",
        f"| torchrun + DDP script, launch to 1st step | {torchrun:.2f} | 1.00 |",
        f"| polytrain DDP, fresh process + local Ray, launch to 1st step | "
        f"{med(r['polytrain_s'] for r in runs):.2f} | {med(r['polytrain_s'] for r in runs) / torchrun:.2f} |",
    ]
    init = med(r["ray_start"]["ray_init_s"] for r in runs)
    lines.append(
        f"| bare `ray.init` (local instance, polytrain's options) | {init:.2f} | {init / torchrun:.2f} |"
    )
    for name in runs[0]["ray_start"]["phases_s"]:
        value = med(r["ray_start"]["phases_s"].get(name, 0.0) for r in runs)
        lines.append(f"|   {name} | {value:.2f} | {value / torchrun:.2f} |")
    loads = [r["load_1min"] for r in runs]
    lines.append(
        f"\n{len(runs)} interleaved reps, 1-minute load {min(loads):.1f}-{max(loads):.1f}."
    )
    return lines
