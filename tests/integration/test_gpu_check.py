"""The GPU check on a CPU: its bundle installs offline and imports without Ray; the check passes.

What this covers (CI has no GPU): ``prepare`` builds the bundle (polytrain's wheel
from this checkout, DeepSpeed and fairscale built from their PyPI sources, the
packages the target image lacks) for the Python running the tests, instead of the
node's 3.12 (the only difference: pydantic-core's compiled wheel); the bundle matches its
manifest, stays under 60 MiB, installs with ``pip --no-index --no-deps`` into a clean
folder, and imports from there with Ray absent and with DeepSpeed, fairscale and the rest
hidden from this machine's environment (``tests/without_ray/sitecustomize.py``): what
imports comes from the bundle. Then ``scripts/gpu_check.sh run --device cpu`` installs
it the same way and runs every backend at fp32 and bf16 on the tiny GPT-2 with gloo under
torchrun, and every loss check passes. Nothing here exercises CUDA, NCCL, fp16 or compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.tools.gpu_check import bundle as gpu_bundle

ROOT = Path(__file__).resolve().parents[2]
HIDER = ROOT / "tests" / "without_ray"
#: What the target image lacks (and Ray), hidden unless the installed bundle brings it.
NODE_LACKS = (
    "ray,deepspeed,fairscale,hjson,pydantic,pydantic_core,annotated_types,typing_inspection,"
    "typing_extensions,omegaconf,horovod,tensorflow"
)
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _node_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(
        PYTHONPATH=os.pathsep.join([str(HIDER), str(site)]),
        POLYTRAIN_HIDDEN_MODULES=NODE_LACKS,
        POLYTRAIN_VISIBLE_IN=str(site),
        PYTHON=sys.executable,
    )
    return env


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "bundle"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    gpu_bundle.prepare(out, python_version=version)
    return out


def test_bundle_matches_its_manifest_and_installs_offline_without_ray(bundle, tmp_path):
    manifest = json.loads((bundle / "manifest.json").read_text())
    names = {entry["name"] for entry in manifest["files"]}
    assert {"polytrain", "deepspeed", "fairscale", "pydantic", "pydantic_core", "hjson"} <= names
    assert gpu_bundle.verify(bundle) == []
    assert manifest["total_mib"] <= 60
    assert (bundle / "gpu_check.sh").exists()
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--target", str(site), *map(str, sorted(bundle.glob("*.whl")))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import importlib, json\n"
        "mods = ['polytrain', 'polytrain.train.torch', 'polytrain.tools.gpu_check.run',\n"
        "        'deepspeed', 'fairscale.optim.oss', 'pydantic', 'hjson']\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "try:\n    import ray\n    files['ray'] = ray.__file__\n"
        "except ModuleNotFoundError:\n    files['ray'] = None\n"
        "print(json.dumps(files))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=_node_env(site),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    files = json.loads(result.stdout.strip().splitlines()[-1])
    assert files.pop("ray") is None
    assert all(path.startswith(str(site)) for path in files.values()), files


def test_check_runs_end_to_end_on_cpu_from_the_bundle(bundle, tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "run", "--bundle", str(bundle),
         "--site", str(site), "--out", str(out), "--device", "cpu"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=_node_env(site),
    )  # fmt: skip
    report_path = out / "report.json"
    assert report_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert f"from {site}" in result.stderr  # the bundle's polytrain ran the check
    assert report["device"]["kind"] == "cpu" and report["software"]["ray"] is None
    by_name = {row["name"]: row for row in report["cases"]}
    backends = ("ddp", "fsdp2", "zero2", "fsdp1", "zero3", "fairscale-oss")
    assert set(by_name) == {
        name
        for precision in ("fp32", "bf16")
        for name in (f"plain-{precision}-nocompile", *(f"{b}-{precision}" for b in backends))
    }
    for row in report["cases"]:
        assert row["status"] == "ok", (row["name"], row.get("error"), row.get("traceback"))
        if row["runner"] == "polytrain":
            assert row["loss_check"] == "pass", (row["name"], row.get("loss_note"))
    assert by_name["fsdp2-fp32"]["model_class"].startswith("FSDP")
    assert by_name["zero3-bf16"]["model_class"] == "DeepSpeedEngine"
    assert by_name["ddp-fp32"]["model_class"] == "DistributedDataParallel"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASSED" in result.stdout and "fsdp1-bf16" in result.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "polytrain.tools.gpu_check", "results", str(report_path),
         "--results-md", str(tmp_path / "RESULTS.md")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 1 and not (tmp_path / "RESULTS.md").exists()
