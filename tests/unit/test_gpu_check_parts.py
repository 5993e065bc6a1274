"""The GPU check's pieces that need no GPU and no run: plan, loss check, report, RESULTS.md, parts."""

from __future__ import annotations

import copy
import json
import os

import pytest

from polytrain.tools.gpu_check import bundle, report
from polytrain.tools.gpu_check import cases as plan_cases
from polytrain.tools.gpu_check import workload as wl


def test_plan_orders_the_goal_cases_first_and_baselines_fsdp1_without_compile():
    cases = plan_cases.plan(("bf16", "fp16"))
    names = [c.name for c in cases]
    assert names[:5] == [
        "plain-bf16",
        "plain-bf16-nocompile",
        "ddp-bf16",
        "fsdp2-bf16",
        "zero2-bf16",
    ]
    assert len(cases) == 2 * (2 + len(plan_cases.BACKENDS))
    fsdp1 = next(c for c in cases if c.name == "fsdp1-bf16")
    assert not fsdp1.compile and fsdp1.baseline == "plain-bf16-nocompile"
    assert all(c.checkpointing for c in cases)
    assert next(c for c in cases if c.name == "zero3-fp16").backend_config == {"stage": 3}
    cpu = plan_cases.plan(("fp32",), compile=False, only=("ddp",))
    assert [c.name for c in cpu] == ["plain-fp32-nocompile", "ddp-fp32"]


def test_token_data_is_learnable_and_the_same_everywhere():
    load = wl.Workload(size="tiny", batch=2, check_steps=3, warmup_steps=0, timed_steps=1)
    a, b = wl.TokenData(load), wl.TokenData(load)
    assert len(a) == 8 and (a.tokens == b.tokens).all()
    assert (a.tokens[0:2] == a.tokens[4:6]).all()  # the check steps fit one batch
    assert not (a.tokens[0:2] == a.tokens[6:8]).all()  # the later steps read fresh ones
    row = a.tokens[0]
    # each next token is a function of the current one (a cycle): the loss can fall
    successor = {}
    for data in (a, b):
        for seq in data.tokens:
            for cur, nxt in zip(seq[:-1].tolist(), seq[1:].tolist(), strict=True):
                assert successor.setdefault(cur, nxt) == nxt
    assert row.max() < wl.SIZES["tiny"]["vocab"]


def test_timed_steps_run_in_chunks_and_the_median_chunk_counts():
    assert wl.Workload(timed_steps=21).chunk_sizes() == [7, 7, 7]
    assert wl.Workload(timed_steps=7).chunk_sizes() == [3, 2, 2]
    assert wl.Workload(timed_steps=2).chunk_sizes() == [1, 1]
    assert wl.timing([0.05, 0.09, 0.051]) == {"step_s": 0.051, "chunk_step_s": [0.05, 0.09, 0.051]}
    assert wl.timing([0.04, 0.06])["step_s"] == pytest.approx(0.05)


def test_flops_and_mfu():
    load = wl.Workload()
    params = 124_000_000
    per_token = wl.flops_per_token(load, params)
    assert per_token == 6 * params + 12 * 12 * 768 * 1024
    assert wl.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert wl.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert wl.peak_tflops("NVIDIA H200") == 989.4
    assert wl.peak_tflops("cpu") is None and wl.mfu(1e5, per_token, None) is None
    assert wl.mfu(400_000, per_token, 989.4) == pytest.approx(400_000 * per_token / 989.4e12)


def _meta(kind="cuda"):
    return {
        "date": "2026-11-28T10:00:00+00:00",
        "elapsed_s": 400.0,
        "device": {"kind": kind, "name": "NVIDIA H100 80GB HBM3", "peak_tflops": 989.4,
                   "dist_backend": "nccl"},
        "software": {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.27.7"},
        "model": {"name": "gpt2-124m", "matmul_params": 124_000_000, "seq": 1024},
        "settings": {"checkpointing": True, "compile": True},
    }  # fmt: skip


def _results(ddp_losses, ddp_step_s=0.05):
    ok = {"status": "ok", "setup_s": 1.0, "first_step_s": 2.0, "wall_s": 30.0}
    return {
        "plain-bf16": {**ok, "losses": [10.0, 9.0, 8.0, 7.0], "step_s": 0.049},
        "ddp-bf16": {**ok, "losses": ddp_losses, "step_s": ddp_step_s},
    }


def test_report_passes_close_losses_and_fails_a_case_that_does_not_train():
    load = wl.Workload(check_steps=4)
    cases = plan_cases.plan(("bf16",), only=("ddp",))
    close = report.build_report(_meta(), load, cases, _results([10.0, 9.05, 8.02, 7.1]))
    ddp = next(r for r in close["cases"] if r["name"] == "ddp-bf16")
    assert ddp["loss_check"] == "pass" and ddp["max_rel_loss_diff"] == pytest.approx(0.1 / 7)
    assert ddp["ratio"] == pytest.approx(0.049 / 0.05)
    assert ddp["tokens_per_s"] == pytest.approx(16 * 1024 / 0.05)
    assert close["goals"][0] == {"case": "ddp-bf16", "goal": "tokens/s >= 0.98 x plain",
                                 "ratio": pytest.approx(0.98), "met": True}  # fmt: skip
    assert close["goals"][1]["met"] is None  # fsdp2 not run
    assert report.verdict(close)

    frozen = report.build_report(_meta(), load, cases, _results([10.0, 10.0, 10.0, 10.0]))
    ddp = next(r for r in frozen["cases"] if r["name"] == "ddp-bf16")
    assert ddp["loss_check"] == "fail" and "step 3" in ddp["loss_note"]
    assert not report.verdict(frozen)
    text = report.table(frozen)
    assert "ddp-bf16" in text and "fail" in text and "goal ddp-bf16" in text


def test_a_crashed_or_skipped_case_fails_the_run():
    load = wl.Workload()
    cases = plan_cases.plan(("bf16",), only=("ddp", "zero3"))
    results = _results([10.0, 9.0, 8.0, 7.0])
    results["zero3-bf16"] = {"status": "crashed", "error": "crashed: the worker exited with -6"}
    out = report.build_report(_meta(), load, cases, results)
    assert not report.verdict(out)
    assert [r["status"] for r in out["cases"]][-1] == "crashed"
    assert "zero3-bf16: crashed" in report.table(out)


def test_results_section_is_appended_and_the_file_before_it_kept(tmp_path):
    load = wl.Workload()
    cases = plan_cases.plan(("bf16",), only=("ddp",))
    built = report.build_report(_meta(), load, cases, _results([10.0, 9.0, 8.0, 7.0]))
    built = json.loads(json.dumps(built))  # as read back from report.json
    results_md = tmp_path / "RESULTS.md"
    before = "# Results\n\nearlier sections\n"
    results_md.write_text(before)
    section = report.append_section(results_md, copy.deepcopy(built))
    text = results_md.read_text()
    assert text.startswith(before) and text.endswith(section)
    assert "## GPU check, 2026-11-28: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0)" in text
    assert "| ddp-bf16 | ok | pass" in text


def test_split_and_join_restore_the_file_and_catch_a_damaged_part(tmp_path):
    original = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    original.write_bytes(os.urandom(int(2.5 * 2**20)))
    parts = bundle.split(original, tmp_path / "parts", max_mib=1)
    assert [p["size"] for p in parts] == [2**20, 2**20, 2**19]
    out = tmp_path / "joined"
    out.mkdir()
    joined = bundle.join(tmp_path / "parts", out)
    assert joined.read_bytes() == original.read_bytes()
    damaged = tmp_path / "parts" / parts[1]["file"]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(RuntimeError, match="SHA-256"):
        bundle.join(tmp_path / "parts", out)


def test_verify_names_missing_changed_and_extra_files(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(b"one")
    bundle.write_manifest(tmp_path, [bundle._entry(wheel, "built")], "test")
    assert bundle.verify(tmp_path) == []
    wheel.write_bytes(b"two")
    (tmp_path / "other-2.0-py3-none-any.whl").write_bytes(b"x")
    problems = bundle.verify(tmp_path)
    assert any("differs" in p for p in problems) and any(
        "not in the manifest" in p for p in problems
    )
