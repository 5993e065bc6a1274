"""Local mode (num_workers=0) runs in the driver process and never starts Ray."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import ray, torch
from polytrain import TorchTrainer
from tests.helpers import DIGITS
trainer = TorchTrainer(**DIGITS, config={"batch_size": 32}, num_workers=0)
stats = trainer.train(num_steps=3)
trainer.save("{path}")
trainer.shutdown()
print("steps", stats["num_steps"], "ray", ray.is_initialized())
"""


def test_local_mode_train_save_shutdown_never_starts_ray(tmp_path):
    code = CODE.replace("{path}", str(tmp_path / "ckpt.pt"))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps 3 ray False" in result.stdout
