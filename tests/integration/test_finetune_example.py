"""examples/finetune_lora.py and its config (issue 40, item 5): a short run of each.

The base is pretrained here for a few steps (the example's own ``pretrain``), so
the runs below find it and skip that. The script LoRA-fine-tunes it on 2 workers:
the answer loss (prompts masked) falls, the adapter it exports loads back with
``peft`` and gives the trained model's answer loss. ``polytrain compare`` runs the
YAML config over two backends (``make test-long``).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.integration.test_cli import REPO_ROOT, run_cli  # noqa: E402


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    from examples import finetune_lora

    folder = str(tmp_path_factory.mktemp("lora") / "base")
    steps = finetune_lora.BASE["steps"]
    finetune_lora.BASE["steps"] = 40  # a short pretraining: the test is about the fine-tune
    try:
        finetune_lora.pretrain(folder)
    finally:
        finetune_lora.BASE["steps"] = steps
    return folder


@pytest.fixture(scope="module")
def ray_address(ray_start_4_cpus):
    return ray_start_4_cpus.get_runtime_context().gcs_address


def test_the_script_lowers_the_answer_loss_and_reloads_its_adapter(ray_address, base_dir, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            sys.executable, "examples/finetune_lora.py", "--backend", "ddp", "--epochs", "2",
            "--base-dir", base_dir, "--out", str(tmp_path),
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    assert proc.returncode == 0, proc.stderr
    before = float(re.search(r"answer loss before fine-tuning: (\d+\.\d+)", proc.stdout)[1])
    epochs = re.findall(r"^epoch \d+: .* answer loss (\d+\.\d+)$", proc.stdout, re.M)
    assert len(epochs) == 2 and float(epochs[-1]) < 0.8 * before, (before, epochs)
    pattern = r"reloaded with peft .*: answer loss (\S+) \(the trained model's: (\S+)\)"
    reloaded = re.search(pattern, proc.stdout)
    assert reloaded[1] == reloaded[2]  # the exported adapter is the trained model
    assert (tmp_path / "adapter-ddp" / "adapter_model.safetensors").exists()
    assert len(re.findall(r"^  upper \w+ -> ", proc.stdout, re.M)) == 3


@pytest.mark.long_matrix
def test_compare_runs_the_config_over_backends(ray_address, base_dir, tmp_path):
    proc = run_cli(
        "compare", "-c", "examples/configs/finetune_lora.yaml", "--backends", "ddp,fsdp",
        "--epochs", "1", "--out", str(tmp_path), "--address", ray_address,
        f"config.base_dir={base_dir}", "config.num_examples=128",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["backend"]: r for r in csv.DictReader((tmp_path / "compare.csv").open())}
    assert [r["status"] for r in rows.values()] == ["ok", "ok"]
