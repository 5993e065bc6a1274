"""The GPT-2 benchmark's pieces that need no launch: sizes, formulas, cases and tables."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import results
from benchmarks.lm import suite as lm_suite
from benchmarks.lm import tables as lm_tables
from benchmarks.native.task import load_task
from benchmarks.workloads.gpt2 import LMSpec


def test_param_count_matches_the_model() -> None:
    """The formulas' Ψ is the model's real parameter count (tied embedding counted once)."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.workloads.gpt2 import gpt2_config

    spec = LMSpec(size="tiny")
    model = transformers.GPT2LMHeadModel(gpt2_config(spec))
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    assert LMSpec(size="memory").num_params() == 354_823_168  # GPT-2 medium


def test_spec_round_trip_and_task_choice() -> None:
    """A spec's JSON picks the GPT-2 task; the MLP's picks the MLP task."""
    spec = LMSpec(size="speed", steps=5)
    task = load_task(spec.to_json())
    assert task.lm and task.spec == spec and task.micro_batch(2) == spec.batch
    assert (spec.n_layer, spec.n_embd, spec.seq) == (6, 512, 256)
    assert not load_task('{"model": "mlp"}').lm


def test_formulas() -> None:
    """Per-rank model states in fp32-Adam terms, N = 2."""
    p = 2**20  # 1 Mi parameters: the MiB figures are the bytes per parameter
    assert lm_tables.formula_mb("ddp", p)[1] == 16
    assert lm_tables.formula_mb("deepspeed", p)[1] == 4 + 6
    assert lm_tables.formula_mb("fairscale", p)[1] == 4 + 6
    assert lm_tables.formula_mb("fsdp", p)[1] == lm_tables.formula_mb("zero3", p)[1] == 8


def test_cases_pair_every_backend_with_its_native_run() -> None:
    """Both suites: a native and a polytrain case per backend, ZeRO-3 through --stage 3."""
    args = argparse.Namespace(
        quick=True, suite="both", memory_steps=3, speed_steps=4, speed_warmup=1
    )
    sections = lm_suite.build_sections(args)
    memory = {c.key: c for c in sections[lm_tables.MEMORY][0]}
    assert len(memory) == 2 * len(lm_tables.MEMORY_TAGS) + 1  # + the meta-init reference
    assert "--meta-init" in memory[lm_tables.META_KEY].commands[0][0]
    zero3 = memory["lm-memory/polytrain-zero3"]
    assert zero3.baseline == "lm-memory/native-zero3"
    assert '"stage": 3' in " ".join(zero3.commands[0][0])
    assert "3" in memory["lm-memory/native-zero3"].commands[0][0][-1]
    speed = [c.key for c in sections[lm_tables.SPEED][0]]
    assert "lm-speed/native-horovod" in speed and len(speed) == 2 * len(lm_tables.SPEED_TAGS)


def _run(step_ms: float, peaks: list[float]) -> dict:
    return {
        "ok": True,
        "step_ms": step_ms,
        "interval_ms": step_ms + 1,
        "launch_s": 1.0,
        "load_before": 0.5,
        "peak_rss_mb": peaks,
        "delta_rss_mb": [p - 100 for p in peaks],
        "baseline_rss_mb": [100.0, 100.0],
        "setup_peak_rss_mb": [p / 2 for p in peaks],
        "niceness": [0, 0],
        "torch_threads": [1, 1],
    }


def _entry(key: str, spec: LMSpec, runs: list[dict]) -> dict:
    prefix, name = key.split("/")
    return {
        "label": name,
        "tag": name.split("-")[1],
        "baseline": None if name.startswith("native") else f"{prefix}/native-{name.split('-')[1]}",
        "spec": spec.__dict__,
        "runs": runs,
        "meta": {"date": "d", "load_start": [0.5] * 3, "load_end": [0.6] * 3, "command": "c"},
    }


def test_tables_render_ratios_per_rank() -> None:
    """Memory ratios rank by rank, speed ratios and missed goals, and the README table."""
    spec = LMSpec(size="tiny")
    memory = {
        k: _entry(k, spec, [_run(10, peaks)])
        for k, peaks in (
            ("lm-memory/native-ddp", [1000.0, 1000.0]),
            ("lm-memory/polytrain-ddp", [1040.0, 1100.0]),
        )
    }
    speed = {
        k: _entry(k, spec, [_run(ms, [1.0, 1.0]) for ms in times])
        for k, times in (
            ("lm-speed/native-ddp", [10, 11, 12]),
            ("lm-speed/polytrain-ddp", [11, 12, 13]),
        )
    }
    results = {lm_tables.MEMORY: memory, lm_tables.SPEED: speed}
    text = "\n".join(lm_tables.render(results))
    assert "1.040 / 1.100: 1.100 (missed, goal <= 1.05)" in text
    assert "1.091 (missed, goal <= 1.03)" in text  # 12 / 11 ms
    assert "- ddp: step ratio 1.091" in text
    assert "| step time, polytrain / native (goal <= 1.03) | 1.091 |" in "\n".join(
        lm_tables.readme_table(results)
    )


def test_results_sections_sort_by_number() -> None:
    """Section 10 comes after section 9 in RESULTS.md, not after section 1."""
    headings = ["### 10. b", "### 2. x", "### 9. a", "### 1. y"]
    assert sorted(headings, key=results.section_order) == [
        "### 1. y",
        "### 2. x",
        "### 9. a",
        "### 10. b",
    ]
