"""The worker side imports and trains without Ray installed (a machine that has only torch).

A subprocess with Ray hidden (``tests/without_ray/sitecustomize.py``): importing
``ray`` fails there as on a machine without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_RAY = ROOT / "tests" / "without_ray"

#: The worker side: the function API and its loop helpers, the creator API's trainer
#: (its local mode), every torch backend's strategy and the step options.
WORKER_MODULES = (
    "polytrain",
    "polytrain.train",
    "polytrain.train.torch",
    "polytrain.train.local",
    "polytrain.trainer_api.torch.trainer",
    "polytrain.backends.registry",
    "polytrain.backends.core.step_options",
    "polytrain.backends.ddp.strategy",
    "polytrain.backends.fsdp.strategy_v1",
    "polytrain.backends.fsdp.strategy_v2",
    "polytrain.backends.fairscale.strategy_oss",
    "polytrain.backends.deepspeed.strategy",
)

CODE = """
import importlib, sys
try:
    import ray
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("ray is not hidden")
for name in {modules!r}:
    importlib.import_module(name)
from polytrain import train
from polytrain.train.torch import TorchTrainer, prepare, backward, step, get_device
# polytrain.train's loop helpers, in local mode (one process, no torchrun)
import torch
def loop():
    model, optimizer = prepare(torch.nn.Linear(4, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    train.report({{"device": str(get_device()), "world": train.get_context().get_world_size(),
                  "checkpoint": train.get_checkpoint()}})
result = TorchTrainer(loop, scaling_config={{"num_workers": 0}},
                      run_config={{"storage_path": {storage!r}}}).fit()
print("metrics", result.metrics)
print("ray loaded:", "ray" in sys.modules)
"""


def run_without_ray(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose ``import ray`` fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(WITHOUT_RAY), str(ROOT)])
    env.pop("POLYTRAIN_HIDDEN_MODULES", None)  # the default: hide Ray only
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(key, None)  # not under torchrun
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )


def test_worker_side_imports_and_a_local_loop_runs_without_ray(tmp_path):
    code = CODE.format(modules=WORKER_MODULES, storage=str(tmp_path / "runs"))
    result = run_without_ray(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "metrics {'device': 'cpu', 'world': 1, 'checkpoint': None}" in result.stdout
    assert "ray loaded: False" in result.stdout


def test_the_hider_really_hides_ray(tmp_path):
    probe = (
        "import importlib.metadata as m, importlib.util as u\n"
        "assert u.find_spec('ray') is None\n"
        "try:\n    m.version('ray')\nexcept m.PackageNotFoundError:\n    print('no metadata')\n"
        "import ray\n"
    )
    result = run_without_ray(probe, tmp_path)
    assert result.returncode != 0
    assert "no metadata" in result.stdout
    assert "No module named 'ray'" in result.stderr
