"""examples/gpt.py and its configs (issue 25, item 8): tiny runs, a few steps each."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.integration.test_cli import REPO_ROOT, run_cli  # noqa: E402

TINY = ("config.num_sequences=64", "config.batch_size=8", "config.n_embd=32", "config.seq_len=32")


@pytest.fixture(scope="module")
def ray_address(ray_start_4_cpus):
    return ray_start_4_cpus.get_runtime_context().gcs_address


def test_the_script_trains_with_clipping_and_accumulation(ray_address):
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            sys.executable, "examples/gpt.py", "--backend", "ddp", "--num-workers", "2",
            "--epochs", "1", "--num-steps", "2", "--batch-size", "8", "--num-sequences", "64",
            "--max-grad-norm", "0.5", "--grad-accum", "2", "--precision", "bf16",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=420, env=env,
    )  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"^epoch 0: loss \d+\.\d+  grad_norm \d+\.\d+ .* \d+ tokens/s$", proc.stdout, re.M
    )


def test_the_fsdp_config_trains_with_checkpointing(ray_address, tmp_path):
    proc = run_cli(
        "train", "-c", "examples/configs/gpt_fsdp.yaml", "--address", ray_address,
        "--out", str(tmp_path), "--no-progress", "epochs=1", "num_steps=2", *TINY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "metrics.jsonl").exists()


def test_compare_reports_tokens_and_grad_norm(ray_address, tmp_path):
    proc = run_cli(
        "compare", "-c", "examples/configs/gpt.yaml", "--backends", "ddp,fsdp", "--epochs", "2",
        "--num-steps", "2", "--out", str(tmp_path), "--address", ray_address, *TINY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["backend"]: r for r in csv.DictReader((tmp_path / "compare.csv").open())}
    assert [r["status"] for r in rows.values()] == ["ok", "ok"]
    for row in rows.values():
        assert float(row["tokens_per_s"]) > 0 and float(row["grad_norm"]) > 0
        assert len(row["losses"].split(";")) == 2
    header = next(line for line in proc.stdout.splitlines() if line.startswith("backend "))
    assert re.search(r"samples/s\s+tokens/s\s+grad norm\s+final loss", header), header
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
