"""``benchmarks/`` is built like the package: folders by suite, no import circle, no long file.

The import graph is read from the source with :mod:`ast` (the reader of
``test_layering``), so it sees every import, the lazy ones inside functions too,
without importing any framework. And every suite of the one entry point,
``benchmarks/run.py``, starts and parses its arguments.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from tests.unit.test_layering import MAX_MODULE_LINES, REPO_ROOT, import_circles, imports_of

BENCHMARKS = REPO_ROOT / "benchmarks"
#: The only modules at the top of ``benchmarks/``: everything else sits in a suite's folder
#: (or in harness/, workloads/, native/, drivers/, which the suites share).
TOP_MODULES = {"__init__.py", "__main__.py", "run.py", "results.py"}


@cache
def _modules() -> dict[str, Path]:
    def name(path: Path) -> str:
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    return {name(p): p for p in sorted(BENCHMARKS.rglob("*.py"))}


@cache
def _graph() -> dict[str, list[str]]:
    """Module of benchmarks/ -> the modules of benchmarks/ it imports, anywhere in its code."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        found = imports_of(path.read_text(), module, path.name == "__init__.py", modules)
        graph[module] = sorted({t for t, _ in found if t in modules and t != module})
    return graph


def test_the_reader_sees_the_benchmarks_imports():
    graph = _graph()
    assert "benchmarks.harness.runner" in graph["benchmarks.lm.suite"]  # from ... import name
    assert "benchmarks.workloads.mlp" in graph["benchmarks.native.task"]  # from pkg import module
    assert "benchmarks.recovery.workload" in graph["benchmarks.recovery.checkpoints"]  # lazy
    assert "benchmarks.run" in graph["benchmarks.__main__"]


def test_no_import_circle_in_benchmarks():
    assert import_circles(_graph()) == []


def test_nothing_imports_the_entry_point():
    """``run.py`` sits on top (the old circle ran through it): only ``__main__`` imports it."""
    importers = sorted(m for m, targets in _graph().items() if "benchmarks.run" in targets)
    assert importers == ["benchmarks.__main__"]


def test_no_benchmarks_file_is_over_800_lines():
    too_long = [
        f"{path.relative_to(REPO_ROOT)}: {lines} lines"
        for path in _modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert too_long == []


def test_benchmarks_are_folders_by_suite():
    flat = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in TOP_MODULES)
    assert flat == [], "a benchmark's modules belong in its suite's folder"


def _suites() -> list[str]:
    from benchmarks import run

    # step-profile hands its arguments to a torchrun/python child process (it imports torch).
    return [name for name in run.SUITES if name != "step-profile"]


@pytest.mark.parametrize("suite", _suites())
def test_every_suite_parses_its_arguments(suite, capsys):
    from benchmarks import run

    with pytest.raises(SystemExit) as exit_info:
        run.main([suite, "--help"])
    assert exit_info.value.code == 0
    assert f"benchmarks/run.py {suite}" in capsys.readouterr().out


def test_the_runner_lists_its_suites_and_refuses_an_unknown_one(capsys):
    from benchmarks import run

    assert run.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in run.SUITES)
    assert run.main(["no-such-suite"]) == 2
    assert "unknown suite 'no-such-suite'" in capsys.readouterr().err
