"""The README and the docs say what is true: the GPU line, and one dated benchmark table.

The benchmark table of the README (and the lead table of docs/benchmarks.md) is one set of
runs: every date it names is the same day, every row names its load average, and every
measured figure in it (a number with three decimals or four digits) is one that
benchmarks/RESULTS.md records. The GPU line names both mixed precisions (bf16 exists).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = (REPO_ROOT / "benchmarks" / "RESULTS.md").read_text()


def _benchmark_table(path: str) -> tuple[str, list[str]]:
    """The text before the first benchmark table of ``path`` and that table's rows."""
    text = (REPO_ROOT / path).read_text()
    if path == "README.md":
        text = text[text.index("## Benchmarks") :]
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| comparison"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return "\n".join(lines[:first]), rows


@pytest.mark.parametrize("path", ["README.md", "docs/benchmarks.md"])
def test_the_benchmark_table_is_one_dated_set_of_runs_from_results(path):
    lead, rows = _benchmark_table(path)
    dates = set(re.findall(r"20\d\d-\d\d-\d\d", lead + "\n".join(rows)))
    assert len(dates) == 1, f"{path}: the table mixes runs of {sorted(dates)}"
    assert all("load" in row for row in rows), f"{path}: a row without its load average"
    figures = {
        f
        for row in rows
        for f in re.findall(r"(?<![\w.])(\d+\.\d{3}|\d{4}(?:\.\d)?)(?![\w.])", row)
    }
    missing = sorted(f for f in figures if f not in RESULTS)
    assert not missing, f"{path}: figures not in benchmarks/RESULTS.md: {missing}"


@pytest.mark.parametrize("path", ["README.md", "docs/index.md", "docs/backends.md"])
def test_the_gpu_line_names_bf16_and_fp16(path):
    text = (REPO_ROOT / path).read_text()
    line = text[text.index("GPU paths are written for") :].split("\n\n")[0]
    assert "bf16" in line and "fp16" in line, line
