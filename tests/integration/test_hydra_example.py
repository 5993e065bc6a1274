"""examples/hydra/train.py end to end: a Hydra app on the session's Ray instance.

The app runs as a real subprocess (``python examples/hydra/train.py ...``) and joins
the shared Ray instance through its ``cluster.address`` key; the runs are a few
steps long so that the module stays well under two minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("hydra")

REPO_ROOT = Path(__file__).resolve().parents[2]
APP = REPO_ROOT / "examples" / "hydra" / "train.py"
TIMEOUT_S = 300
SHORT = ("trainer.epochs=1", "trainer.num_steps=2", "trainer.config.batch_size=32")


@pytest.fixture(scope="module")
def ray_address(ray_start_4_cpus):
    return ray_start_4_cpus.get_runtime_context().gcs_address


def run_app(*overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # This checkout's polytrain, whatever the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(APP), *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    return proc


def _final_metrics(job_dir: Path) -> dict:
    final = json.loads((job_dir / "metrics.json").read_text())
    epochs = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 1 and epochs[0]["loss"] == final["loss"]
    assert math.isfinite(final["loss"]) and "val_accuracy" in final
    return final


def test_overrides_pick_the_backend_and_the_trainer_keys(ray_address, tmp_path):
    pytest.importorskip("horovod.torch")
    proc = run_app(
        "backend=horovod",
        "trainer.num_workers=2",
        "trainer.use_gpu=false",
        *SHORT,
        f"cluster.address={ray_address}",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final metrics (horovod):" in proc.stdout
    final = _final_metrics(tmp_path)
    assert final["backend"] == "horovod" and final["num_workers"] == 2
    # Hydra kept the composed config, with the group's values in the run config.
    composed = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    assert composed["backend"]["name"] == "horovod"
    assert composed["trainer"]["num_workers"] == 2


def test_multirun_trains_one_job_per_backend(ray_address, tmp_path):
    pytest.importorskip("horovod.torch")
    pytest.importorskip("deepspeed")
    backends = ["ddp", "horovod", "deepspeed"]
    proc = run_app(
        "-m",
        f"backend={','.join(backends)}",
        *SHORT,
        f"cluster.address={ray_address}",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for num, backend in enumerate(backends):
        job_dir = tmp_path / str(num)
        assert f"backend={backend}" in (job_dir / ".hydra" / "overrides.yaml").read_text()
        assert _final_metrics(job_dir)["backend"] == backend
    deepspeed = yaml.safe_load((tmp_path / "2" / ".hydra" / "config.yaml").read_text())
    assert deepspeed["trainer"]["backend_config"] == "${backend.backend_config}"
    assert deepspeed["backend"]["backend_config"] == {"stage": 2}


def test_a_missing_value_fails_naming_the_key(tmp_path):
    proc = run_app("trainer.epochs=???", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "the value of 'trainer.epochs' is missing" in proc.stderr
