"""GPU paths: NCCL process groups, one GPU per worker, fp16 with a GradScaler.

Skipped (not failed) on machines without a CUDA device; see tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.registry import get_spec
from tests.helpers import DIGITS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_start_4_cpus")]

GPU_CASES = [
    ("ddp", None),
    ("horovod", None),
    ("fairscale", {"mode": "sddp"}),
    ("fairscale", {"mode": "fsdp"}),
    ("fsdp", None),
    ("deepspeed", {"stage": 2}),
]


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(("backend", "backend_config"), GPU_CASES)
@pytest.mark.parametrize("use_fp16", [False, True])
def test_trains_on_gpus(ray_start_4_cpus, backend, backend_config, use_fp16, tmp_path):
    if not get_spec(backend).installed:
        pytest.skip(f"{backend} is not installed")
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    workers = min(2, _num_gpus())
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=workers,
        use_gpu=True,
        use_fp16=use_fp16,
        backend=backend,
        backend_config=backend_config,
    )
    try:
        devices = trainer.apply_all_operators(lambda op: str(op.device))
        first = trainer.train()
        for _ in range(3):
            last = trainer.train()
        val = trainer.validate()
        path = trainer.save(tmp_path / "gpu.pt")
    finally:
        trainer.shutdown()
    assert all(device.startswith("cuda") for device in devices)
    assert last["loss"] < first["loss"]
    assert val["val_accuracy"] > 0.8
    cpu = TorchTrainer(**DIGITS, config={"batch_size": 64}, num_workers=0)
    try:
        cpu.load(path)  # a GPU checkpoint loads on CPU
        assert abs(cpu.validate()["val_loss"] - val["val_loss"]) < 1e-2
    finally:
        cpu.shutdown()


def test_ddp_uses_nccl(ray_start_4_cpus):
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    trainer = TorchTrainer(**DIGITS, config={"batch_size": 64}, num_workers=1, use_gpu=True)
    try:
        backends = trainer.apply_all_workers(
            lambda: torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        )
    finally:
        trainer.shutdown()
    assert backends == ["nccl"]
