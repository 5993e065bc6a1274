"""`polytrain submit` against a Ray head with token authentication (issue 17, point 5).

The head runs with ``RAY_AUTH_MODE=token`` and a token of its own, in its own temp
dir and ports on 127.0.0.1 (``ray stop`` would stop every Ray on the machine: it
is stopped by signalling its process group). ``polytrain submit`` runs in fresh
processes whose environment holds the token (``RAY_AUTH_TOKEN`` or
``RAY_AUTH_TOKEN_PATH``, with no ``RAY_AUTH_MODE``), no token, or a wrong one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.harness.cases import free_ports
from tests.integration.cluster_processes import stop_ray_head

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER = "token-accepted-5c21"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")
    }
    env.update(extra)
    return env


def _wait_for_dashboard(proc, address: str, token: str, log_path: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited: {log_path.read_text()}")
        try:
            JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"}).list_jobs()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                pytest.fail(f"the dashboard at {address} did not come up in 240 s")
            time.sleep(2)


@pytest.fixture(scope="module")
def token_head():
    """(dashboard address, token) of a Ray head that requires the token."""
    temp_dir = tempfile.mkdtemp(prefix="ptauth", dir="/tmp")
    token = secrets.token_hex(16)
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env_agent, node_manager, object_manager = free_ports(9)  # fmt: skip
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
        f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=1",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env_agent}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", "--disable-usage-stats",
    ]  # fmt: skip
    log_path = Path(temp_dir) / "ray_start.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_dashboard(proc, address, token, log_path)
        yield address, token
    finally:
        stop_ray_head(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(address: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "polytrain", "submit", "--address", address, "--no-working-dir",
        *extra, "--", sys.executable, "-c", "print('token-accepted-' + '5c21')",  # MARKER, if it ran
    ]  # fmt: skip
    return subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


def test_token_from_the_environment_is_sent(token_head):
    address, token = token_head
    # No RAY_AUTH_MODE in the submitting shell: Ray's own client would send nothing.
    proc = _submit(address, _clean_env(RAY_AUTH_TOKEN=token))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert MARKER in proc.stdout and "SUCCEEDED" in proc.stdout


def test_token_from_a_file_is_sent(token_head, tmp_path):
    address, token = token_head
    path = tmp_path / "token"
    path.write_text(token + "\n")
    proc = _submit(address, _clean_env(RAY_AUTH_TOKEN_PATH=str(path)), "--no-wait")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "submitted" in proc.stdout


@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_is_refused_with_the_fix(token_head, token, tmp_path):
    address, real = token_head
    # HOME elsewhere: no ~/.ray/auth_token can stand in for the missing token.
    env = _clean_env(RAY_AUTH_MODE="disabled", HOME=str(tmp_path))
    if token is not None:
        env.update(RAY_AUTH_TOKEN=token.ljust(len(real), "0"))
    proc = _submit(address, env)
    assert proc.returncode != 0
    assert f"The Ray Jobs API at {address} refused the request" in proc.stderr, proc.stderr
    assert "export RAY_AUTH_TOKEN=<token>" in proc.stderr
    assert MARKER not in proc.stdout
