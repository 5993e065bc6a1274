"""Shared fixtures: one Ray instance per pytest process, environment-leak guard, skip markers."""

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
    "TF_USE_LEGACY_KERAS",  # once TensorFlow is imported with tf_keras, the process keeps it
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


def _worker_pythonpath() -> str:
    """The checkout first, then whatever the driver's PYTHONPATH holds."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([str(REPO_ROOT), *extra]))


@pytest.fixture(scope="session")
def ray_start_4_cpus():
    """One local Ray instance with 4 logical CPUs, shared by this process's tests that need Ray."""
    import ray

    if not ray.is_initialized():
        ray.init(
            # Always a new instance of this process's own (make test runs two pytest
            # processes), never a cluster RAY_ADDRESS or a `ray start` session file names.
            address="local",
            num_cpus=4,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            # The driver's PYTHONPATH too: Ray itself may live there (the GPU check's node).
            runtime_env={"env_vars": {"PYTHONPATH": _worker_pythonpath()}},
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
    _skip_long_matrix(items)
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        # The marker, not the keywords: those hold every parent folder's name too (a
        # checkout in a folder named "gpu" would skip everything).
        if item.get_closest_marker("gpu") is not None:
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


# ------------------------------------------------------------------ RELIABILITY.md
# The reliability figures come from the test run itself: every fault-injection, hang and
# bad-input test's outcome is collected and, when the fault-injection tests ran, written
# to RELIABILITY.md at the end of the session.
_RELIABILITY_FILES = ("test_reliability.py", "test_bad_input.py")
_reliability_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if not report.nodeid.split("::")[0].endswith(_RELIABILITY_FILES):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _reliability_outcomes[report.nodeid] = report.outcome
    elif report.when == "teardown" and report.outcome == "failed":
        _reliability_outcomes[report.nodeid] = "failed"


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controlling process gets every report and writes
    faults = {
        nodeid.split("[", 1)[1].rstrip("]"): outcome
        for nodeid, outcome in _reliability_outcomes.items()
        if "test_sigkilled_worker_is_replaced" in nodeid and "[" in nodeid
    }
    if not faults:
        return
    import datetime
    import platform

    def count(pattern: str) -> tuple[int, int]:
        runs = [o for n, o in _reliability_outcomes.items() if pattern in n and o != "skipped"]
        return len(runs), sum(o == "passed" for o in runs)

    lines = [
        "# Reliability record",
        "",
        f"Written by the test run of {datetime.date.today()} on {platform.machine()} "
        f"({os.cpu_count()} CPU cores), `pytest tests/integration/test_reliability.py "
        f"tests/integration/test_bad_input.py`. Regenerated whenever those tests run.",
        "",
        "## Worker killed with SIGKILL in the middle of epoch 2 of 4 (max_retries=3)",
        "",
        "Survived = training completed, exactly 1 restart, final validation loss within 10% "
        "of an uninjected run with the same seed.",
        "",
        "| backend | faults injected | survived |",
        "|---|---|---|",
    ]
    for case, outcome in sorted(faults.items()):
        injected = 0 if outcome == "skipped" else 1
        lines.append(f"| {case} | {injected} | {int(outcome == 'passed')} |")
    rows = {
        "test_hang_": "| hang detected within hang_timeout_s + 10 s, stuck rank and stacks "
        "reported, then raised or recovered |",
        "test_elastic_": "| elastic: shrink after a failure, keep the global batch, grow back |",
        "test_bad_input.py": "| bad inputs (one test per row of the table in docs/failures.md; clear "
        "error, no actor left) |",
    }
    lines += ["", "## Hangs, elastic restarts, bad input", "", "| check | tried | passed |"]
    lines.append("|---|---|---|")
    lines += [_reliability_row(label, *count(pattern)) for pattern, label in rows.items()]
    generated = [line for line in lines if line.startswith("## ")]
    lines += _other_reliability_sections(generated)
    (REPO_ROOT / "RELIABILITY.md").write_text("\n".join([*lines, ""]))


def _other_reliability_sections(generated: list[str]) -> list[str]:
    """The sections of RELIABILITY.md that this hook does not write (the chaos run's), kept as they are."""
    path = REPO_ROOT / "RELIABILITY.md"
    if not path.exists():
        return []
    kept: list[str] = []
    keep = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            keep = line not in generated
        if keep:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    return ["", *kept] if kept else []


def _reliability_row(label: str, tried: int, passed: int) -> str:
    """A row of this run; a check this run did not include keeps the figures it had."""
    if tried:
        return f"{label} {tried} | {passed} |"
    path = REPO_ROOT / "RELIABILITY.md"
    previous = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in previous if line.startswith(label)]
    return kept[0] if kept else f"{label} not run | - |"


# ------------------------------------------------------------------ long matrices
# A backend x option matrix runs a covering set of pairs in every run; the other cases are
# marked long_matrix and run with POLYTRAIN_LONG_TESTS=1 (make test-long).
def _skip_long_matrix(items):
    if os.environ.get("POLYTRAIN_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long matrix case: run with make test-long")
    for item in items:
        if "long_matrix" in item.keywords:
            item.add_marker(skip)
