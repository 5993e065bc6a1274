"""``results``: a GPU check's report as a dated section at the end of ``benchmarks/RESULTS.md``.

    python -m polytrain.tools.gpu_check results REPORT.json [--results-md benchmarks/RESULTS.md]
    python -m polytrain.tools.gpu_check results REPORT.json --print   # the section only

The section names the device, the date, torch's, CUDA's and NCCL's versions and
every case's figures (:func:`polytrain.tools.gpu_check.report.results_section`).
The file is only appended to: what is there stays as it was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polytrain.tools.gpu_check import report as reporting


def main(argv: list[str] | None = None) -> int:
    """Append (or print) the report's section; 1 for a report of a CPU run unless ``--allow-cpu``."""
    parser = argparse.ArgumentParser(prog="python -m polytrain.tools.gpu_check results")
    parser.add_argument("report", help="report.json written by the run")
    parser.add_argument("--results-md", default="benchmarks/RESULTS.md")
    parser.add_argument("--print", action="store_true", help="print the section, write nothing")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="also a --device cpu run (a smoke run: not results)")  # fmt: skip
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    if args.print:
        print(reporting.results_section(report))
        return 0
    if report["device"].get("kind") != "cuda" and not args.allow_cpu:
        print(f"{args.report} is a {report['device'].get('kind')} run: RESULTS.md takes GPU "
              f"runs only (pass --allow-cpu to add it anyway).")  # fmt: skip
        return 1
    section = reporting.append_section(Path(args.results_md), report)
    print(f"appended to {args.results_md}:\n\n{section}")
    return 0
