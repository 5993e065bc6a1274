"""The chaos run (issue 28, item 4): a seeded fault schedule over a long training run.

Per backend, on a simulated multi-node cluster (``ray.cluster_utils.Cluster``: a
CPU-less head on 127.0.0.1 and 2-CPU worker nodes on 127.0.0.2, .3, ...; the
workers SPREAD one per worker node), the same training runs twice, each run a
sequence of driver processes (``benchmarks/chaos/driver.py``, ``resume=True``):

* the *reference*: no fault, start to end;
* the *chaos run*: a seeded schedule of ``(step, fault kind, target rank)`` is
  injected from outside while it trains:

  ============================  =============================================================
  ``kill_worker``               SIGKILL of the target rank's worker process
  ``hang_worker``               SIGSTOP of it: a frozen worker the hang watchdog must catch
  ``remove_node``               the node of the target rank goes away (raylet and workers
                                killed; graceful or not, seeded); a replacement node joins
  ``drain_deadline``            the node is drained (a preemption announced through the
                                GCS call of ``ray drain-node``) with a deadline; a replacement
                                joins at once, and at the deadline the node is killed if still up
  ``drain_no_deadline``         the same drain without a deadline
  ``driver_sigterm``            SIGTERM to the driver process: it checkpoints, exits 143, and
                                the next driver segment resumes
  ============================  =============================================================

Then: the final weights of both runs (bit for bit, or the largest difference), the
steps lost per fault against the designed bound (from the steps log rank 0 writes:
a step trained twice was lost once), the wall time lost per fault (the time of the
fault's window beyond what its new steps take at the reference run's pace), actors
and placement groups left alive in the cluster once the drivers are gone, worker
processes left running, and stray files in the checkpoint directory (anything but
committed checkpoints within ``num_to_keep``).

Usage::

    python benchmarks/run.py chaos --backends ddp,mwms --faults 20 --seed 0 --out DIR
    python benchmarks/run.py chaos --backends ddp --faults 3 \
        --kinds kill_worker,hang_worker,driver_sigterm --out DIR        # a short run

Writes ``DIR/chaos.json`` (everything) and ``DIR/chaos.md`` (the tables of
RELIABILITY.md); exits 0 when every backend passed every check. The parts: the
schedule (:mod:`~benchmarks.chaos.schedule`), the simulated cluster
(:mod:`~benchmarks.chaos.cluster`), one run and its fault injection
(:mod:`~benchmarks.chaos.orchestrator`, :mod:`~benchmarks.chaos.driver`,
:mod:`~benchmarks.chaos.workload`), the analysis (:mod:`~benchmarks.chaos.analysis`)
and the report (:mod:`~benchmarks.chaos.report`); this module runs the cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.chaos.analysis import analyse, checks, compare_weights, stray_files
from benchmarks.chaos.cluster import SimCluster, processes_left
from benchmarks.chaos.orchestrator import ChaosRun, Options
from benchmarks.chaos.report import report, update_reliability
from benchmarks.chaos.schedule import ALL_CASES, KINDS, framework_of, make_schedule
from benchmarks.chaos.workload import STEPS_PER_EPOCH

REPO = Path(__file__).resolve().parents[2]
#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "chaos"


def _private_cluster_environment() -> str:
    """Set this process's environment for a private test cluster; returns its RAY_TMPDIR.

    The cluster's processes (raylets, workers, the drivers) inherit it.
    """
    # The raylets' workers import the workload as benchmarks.chaos.workload: this
    # repository first (fairscale installs a top-level ``benchmarks`` package too).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    # Ray's socket paths must stay short: a private, short RAY_TMPDIR (never the shared /tmp/ray).
    ray_tmp = tempfile.mkdtemp(prefix="ptch", dir="/tmp")
    os.environ["RAY_TMPDIR"] = ray_tmp
    os.environ.pop("RAY_ADDRESS", None)
    # A private cluster on loopback addresses, for this process and its drivers only.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    return ray_tmp


def run_case(case: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The reference and the chaos run of one case on a fresh simulated cluster."""
    framework = framework_of(case)
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    schedule = make_schedule(args.faults, args.seed, kinds, gap=args.gap)  # the same for every case
    last = schedule[-1].step if schedule else 0
    epochs = max(2, math.ceil((last + args.tail) / STEPS_PER_EPOCH))
    total = epochs * STEPS_PER_EPOCH
    options = Options(
        every_n_steps=args.every_n_steps,
        step_sleep_s=args.step_sleep_s,
        hang_timeout_s=args.hang_timeout_s,
        drain_deadline_s=args.drain_deadline_s,
    )
    result: dict[str, Any] = {
        "case": case,
        "framework": framework,
        "epochs": epochs,
        "total_steps": total,
        "schedule": [asdict(f) for f in schedule],
    }
    case_dir = out / case
    shutil.rmtree(case_dir, ignore_errors=True)
    print(f"[chaos] {case}: {len(schedule)} faults over {total} steps", flush=True)
    sim = None
    try:
        sim = SimCluster()
        references = []
        for i in range(2 if args.check_reference else 1):
            ref = ChaosRun(case, case_dir / f"reference{i or ''}", epochs, sim, options, [])
            wall = ref.run()
            references.append(ref)
            result[f"reference{i or ''}"] = {
                "wall_s": round(wall, 1),
                "error": ref.error,
                "segments": ref.segments,
                "stray_files": stray_files(ref.state.run_dir),
            }
            print(
                f"[chaos] {case}: reference{i or ''} in {wall:.0f} s ({ref.error or 'ok'})",
                flush=True,
            )
        if args.check_reference:
            result["references_equal"] = compare_weights(
                references[0].state.run_dir / "final.pt", references[1].state.run_dir / "final.pt"
            )
        chaos = ChaosRun(case, case_dir / "chaos", epochs, sim, options, schedule)
        wall = chaos.run()
        print(f"[chaos] {case}: chaos run in {wall:.0f} s ({chaos.error or 'ok'})", flush=True)
        result["chaos"] = {
            "wall_s": round(wall, 1),
            "error": chaos.error,
            "segments": chaos.segments,
            "faults": chaos.faults,
            "log": analyse(chaos, references[0].state.steps, total, args.every_n_steps),
        }
        result["weights"] = compare_weights(
            references[0].state.run_dir / "final.pt", chaos.state.run_dir / "final.pt"
        )
        result["leftovers"] = SimCluster.leftovers()
        result["processes_left"] = processes_left({**chaos.state.pids, **references[0].state.pids})
        result["stray_files"] = stray_files(chaos.state.run_dir)
        result["time_lost_s"] = round(wall - result["reference"]["wall_s"], 1)
    except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        if sim is not None:
            sim.shutdown()
    result["checks"] = checks(result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the chaos run for every requested backend; 0 when every check passed."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--backends", default=",".join(ALL_CASES), help="cases: backend names or registry case ids"
    )
    parser.add_argument("--faults", type=int, default=20, help="faults per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "chaos"))
    parser.add_argument("--kinds", default="", help=f"comma-separated subset of {', '.join(KINDS)}")
    parser.add_argument("--every-n-steps", type=int, default=4)
    parser.add_argument("--step-sleep-s", type=float, default=0.05)
    parser.add_argument("--hang-timeout-s", type=float, default=8.0)
    parser.add_argument("--drain-deadline-s", type=float, default=10.0)
    parser.add_argument("--gap", type=int, default=10, help="steps between two scheduled faults")
    parser.add_argument("--tail", type=int, default=8, help="steps after the last fault")
    parser.add_argument(
        "--check-reference",
        action="store_true",
        help="a second reference run: are uninterrupted runs bit-equal?",
    )
    parser.add_argument(
        "--update-reliability",
        metavar="PATH",
        help="write the tables into the chaos section of this RELIABILITY.md",
    )
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.kinds.split(","))) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray_tmp = _private_cluster_environment()
    results = []
    start = time.monotonic()
    try:
        for case in filter(None, args.backends.split(",")):
            results.append(run_case(case, args, out))
            (out / "chaos.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(ray_tmp, ignore_errors=True)
    text = report(results, args) + f"\nTotal wall time {time.monotonic() - start:.0f} s.\n"
    (out / "chaos.md").write_text(text)
    if args.update_reliability:
        command = " ".join(
            ["python benchmarks/run.py", NAME, *(sys.argv[1:] if argv is None else argv)]
        )
        update_reliability(Path(args.update_reliability), text, command)
    print(text, flush=True)
    return 0 if all(all(r["checks"].values()) for r in results) else 1
