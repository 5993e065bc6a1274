"""Shared fixtures: one Ray instance per session, environment-leak guard, skip markers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# Environment variables that Ray, torch or TensorFlow set once per process on purpose.
# Anything a trainer sets for its workers (MASTER_ADDR, RANK, HOROVOD_*, ...) must stay
# out of the driver, or be restored by shutdown() in local mode.
_ENV_ALLOWED_TO_CHANGE = (
    "PYTEST_",
    "RAY_",
    "KMP_",
    "OMP_",
    "TORCHINDUCTOR_CACHE_DIR",  # torch sets it once, at the first torch.optim optimizer
    "TF2_BEHAVIOR",
    "TPU_ML_PLATFORM",
    "HDF5_PLUGIN_PATH",
    "ENABLE_RUNTIME_UPTIME_TELEMETRY",
    "CRC32C_SW_MODE",  # tensorboardX (Ray Tune's TensorBoard logger), on import
    "PYTORCH_NVML_BASED_CUDA_CHECK",  # lightning_fabric, on import
    "GRPC_",
    "TOKENIZERS",
    "CUBLAS",
    "MKL",
    "__KMP",
)


@pytest.fixture(scope="session")
def ray_start_4_cpus():
    """One local Ray instance with 4 logical CPUs, shared by every test that needs Ray."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
            configure_logging=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_env_leak(request):
    """Fail a test that changes the driver's environment (like Lightning's guard)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = {
        key
        for key in set(before) | set(after)
        if before.get(key) != after.get(key) and not key.startswith(_ENV_ALLOWED_TO_CHANGE)
    }
    if changed:
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"Test leaked environment variable changes: {sorted(changed)}")


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def no_leftover_actors(ray_start_4_cpus):
    """Assert the test leaves every CPU free again (no actor or placement group left)."""
    import time

    ray = ray_start_4_cpus
    yield
    deadline = time.time() + 10
    while time.time() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return
        time.sleep(0.2)
    pytest.fail(
        f"Actors or placement groups left behind: available {ray.available_resources()} of "
        f"{ray.cluster_resources()}"
    )
