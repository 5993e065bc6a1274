"""The benchmarks' one entry point: ``python benchmarks/run.py SUITE [options]``.

Every suite measures polytrain against what a user would run without it, and
writes its figures where the documentation reads them (``benchmarks/RESULTS.md``,
``RELIABILITY.md``, ``docs/assets/``). ``python benchmarks/run.py SUITE --help``
shows a suite's options; with no suite name (or options first), the side-by-side
suite runs, as ``make bench`` does. The suites, by folder:

* ``sidebyside/``: every backend against its native launcher and Ray Train
  (RESULTS.md 1-4), ``polytrain launch`` against torchrun (11), the Lightning
  strategies (12), with the start-up section (5, ``startup/warm.py``);
* ``lm/``: GPT-2 memory per rank and speed (9-10);
* ``startup/``: cold launch with a fresh Ray taken apart (13), the CLI on a
  running cluster (14);
* ``recovery/``: checkpoints at scale and recovery time (6), what recovery costs
  the driver (7);
* ``chaos/``: a seeded fault schedule on a simulated cluster (RELIABILITY.md);
* ``drivers/step_profile.py``: where a step's time goes (8, 15).

They share ``harness/`` (cases, launching and saving runs, table cells),
``workloads/`` (what every runner trains and records), and the scripts the runs
start: ``native/`` (hand-written scripts under their native launchers) and
``drivers/`` (polytrain and Ray Train driver scripts). ``python -m benchmarks``
is the same entry point.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # fairscale installs a top-level ``benchmarks`` package: this repository's must win.
    sys.path.insert(0, str(ROOT))

from benchmarks.chaos import suite as chaos  # noqa: E402
from benchmarks.harness.cases import python_command, torchrun_command  # noqa: E402
from benchmarks.lm import suite as lm  # noqa: E402
from benchmarks.recovery import checkpoints, driver_cost, time_to_recover  # noqa: E402
from benchmarks.sidebyside import figure  # noqa: E402
from benchmarks.sidebyside import suite as sidebyside  # noqa: E402
from benchmarks.startup import cli_launch, cold_launch  # noqa: E402

STEP_PROFILE = "drivers/step_profile.py"


def step_profile(argv: list[str]) -> int:
    """``drivers/step_profile.py`` under its launcher: torchrun for ``--mode native``, else Python."""
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode")
    native = mode.parse_known_args(argv)[0].mode == "native"
    command = (torchrun_command if native else python_command)(STEP_PROFILE, *argv)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}).returncode


#: Every suite: its ``main(argv) -> exit status`` and what it measures (and where it writes).
SUITES: dict[str, tuple[Callable[[list[str]], int], str]] = {
    sidebyside.NAME: (
        sidebyside.main,
        "backends vs native launchers and Ray Train, start-up, polytrain launch, Lightning "
        "(RESULTS.md 1-5, 11, 12; the default, make bench)",
    ),
    lm.NAME: (lm.main, "GPT-2 memory per rank and speed vs native launchers (RESULTS.md 9-10)"),
    cold_launch.NAME: (cold_launch.main, "cold launch vs torchrun, ray.init by phase (13)"),
    cli_launch.NAME: (cli_launch.main, "the CLI on a running cluster vs torchrun (14)"),
    checkpoints.NAME: (checkpoints.main, "checkpoint save/load/stall at 48M parameters (6)"),
    time_to_recover.NAME: (time_to_recover.main, "recovery after a SIGKILL per backend (6)"),
    driver_cost.NAME: (driver_cost.main, "what keeping a recovery state costs the driver (7)"),
    chaos.NAME: (chaos.main, "seeded faults on a simulated cluster (RELIABILITY.md; make chaos)"),
    "step-profile": (step_profile, "where a step's time goes, native vs polytrain (8, 15)"),
    figure.NAME: (figure.main, "redraw docs/assets/benchmarks.png from sections 1-4's numbers"),
}
DEFAULT = sidebyside.NAME


def usage() -> str:
    """The list of suites (``run.py --help``)."""
    width = max(map(len, SUITES))
    rows = [f"  {name:<{width}}  {text}" for name, (_, text) in SUITES.items()]
    return (
        "usage: python benchmarks/run.py [SUITE] [options]   (SUITE --help: its options)\n\n"
        + __doc__.split("\n\n")[0]
        + "\n\nsuites:\n"
        + "\n".join(rows)
        + f"\n\nWith no suite name (or options first): {DEFAULT}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the suite named first in ``argv`` (the side-by-side suite when none is) with the rest."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name = DEFAULT if not argv or argv[0].startswith("-") else argv.pop(0)
    if name not in SUITES:
        print(usage(), file=sys.stderr)
        print(f"run.py: unknown suite {name!r}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    return SUITES[name][0](argv)


if __name__ == "__main__":
    sys.exit(main())
