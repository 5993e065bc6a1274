"""Local mode under torchrun, without Ray: the function API's loop as ranks of torchrun's world.

``torchrun --nproc-per-node 2`` runs ``torchrun_local_loop.py`` (``TorchTrainer(loop,
scaling_config=ScalingConfig(num_workers=0))``) with ``import ray`` failing in every
process; the same script as one plain process is the reference. The two ranks
(gloo, each half the global batch, DDP averaging the gradients) must report the
one process's per-step losses and end with its weights; rank 0's board commits
the checkpoint both ranks reported, every rank's ``fit()`` returns it, and a second
``fit()`` of the same run starts from it (``get_checkpoint()``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polytrain.launchers.torchrun import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("torchrun_local_loop.py")
WITHOUT_RAY = ROOT / "tests" / "without_ray"


def _run(args: list[str], out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(WITHOUT_RAY), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    out.mkdir(parents=True)
    # A session of its own: on a timeout the ranks torchrun started go too, not only torchrun.
    proc = subprocess.Popen(
        [sys.executable, *args, str(SCRIPT), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after 300 s: {stdout[-2000:]}{stderr[-4000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]


def _weights(result: dict) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(result["checkpoint"], "model.pt"), weights_only=True)


def test_two_torchrun_ranks_without_ray_train_like_one_process(tmp_path):
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2"], tmp_path / "torchrun")
    _run([], tmp_path / "single")
    ranks = [
        json.loads((tmp_path / "torchrun" / f"result-rank{r}.json").read_text()) for r in (0, 1)
    ]
    single = json.loads((tmp_path / "single" / "result-rank0.json").read_text())

    assert ranks[0] == ranks[1]  # every rank's fit() returns rank 0's Result
    two = ranks[0]
    assert not two["ray_imported"] and not single["ray_imported"]
    assert two["worlds"] == [2] and single["worlds"] == [1]
    assert two["reporting_rank"] == [0]  # Result holds rank 0's reports
    assert len(two["losses"]) == 6
    # gloo's allreduce sums in another order than one process's batch mean: float32 rounding
    assert two["losses"] == pytest.approx(single["losses"], rel=1e-5)
    a, b = _weights(two), _weights(single)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    # the checkpoint both ranks reported, committed by rank 0 once both had copied it
    assert two["checkpoint"].endswith("checkpoint_000005")
    assert {"COMMITTED", "model.pt", "step.json"} <= set(two["files"])
    # a second fit() of the run: get_checkpoint() returned that checkpoint (step 6, +1)
    assert two["resumed_checkpoints"] == 1 and two["resumed_step"] == 7
    # torchrun's process group stays for the process: the second fit() used it
    assert two["dist_left_initialized"] and not single["dist_left_initialized"]
