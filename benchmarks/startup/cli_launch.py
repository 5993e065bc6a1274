"""The CLI on a running cluster against torchrun: launch to the first forward of the same job.

Starts a Ray head (``ray start --head``) unless ``--address`` names one, then
interleaves, per repetition: ``torchrun`` + ``native/digits_torchrun.py`` and
``polytrain train -c examples/configs/ddp.yaml`` with the same model wrapped to print its
first forward's time, and ``polytrain launch -n 2`` of the torchrun script on the same
cluster. Prints each launch to the latest rank's first forward and the medians' ratios.

Usage: python benchmarks/run.py cli-launch [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "cli-launch"
BIN = Path(sys.executable).parent
SCRIPT = str(ROOT / "benchmarks" / "native" / "digits_torchrun.py")
MODEL = "model=benchmarks.native.digits_torchrun:timed_model_creator"
FIRST = re.compile(r"FIRST_FORWARD (\d+\.\d+)")


def _env() -> dict[str, str]:
    # A `benchmarks` package in site-packages would shadow this repository's.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}


def _launch_to_first_forward(argv: list[str]) -> float:
    start = time.time()
    out = subprocess.run(
        argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False
    )
    stamps = [float(m) for m in FIRST.findall(out.stdout + out.stderr)]
    # Only the launch is timed: a gloo abort at a rank's exit after training (seen on this
    # machine now and then, in both runners) does not void it.
    if len(stamps) < 2:
        raise RuntimeError(
            f"{argv} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    return max(stamps) - start


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved reps against a running cluster and print the table."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--address", default=None, help="a running cluster (default: start one)")
    args = parser.parse_args(argv)
    started = args.address is None
    if started:
        subprocess.run(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            check=True,
            capture_output=True,
        )
    address = args.address or "auto"
    out_dir = Path(tempfile.mkdtemp(prefix="polytrain-cli-"))
    commands = {
        "torchrun + script": [str(BIN / "torchrun"), "--nproc_per_node=2", SCRIPT],
        "polytrain train -c ddp.yaml": [
            str(BIN / "polytrain"),
            "train",
            "-c",
            "examples/configs/ddp.yaml",
            "--no-progress",
            "--address",
            address,
            "--out",
            str(out_dir / "train"),
            "epochs=1",
            MODEL,
        ],
        "polytrain launch -n 2 (same script)": [
            str(BIN / "polytrain"),
            "launch",
            "-n",
            "2",
            "--address",
            address,
            SCRIPT,
        ],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    try:
        for rep in range(args.reps):
            load = os.getloadavg()[0]
            for name, argv in commands.items():
                times[name].append(_launch_to_first_forward(argv))
            print(
                f"rep {rep}: "
                + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
                + f" (load {load:.1f})",
                flush=True,
            )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if started:
            subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, check=False)
    base = statistics.median(times["torchrun + script"])
    print(
        "\n| Runner (Ray already running) | launch to 1st forward (s, median) | ratio |\n|---|---|---|"
    )
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f} |"
        )
    return 0
