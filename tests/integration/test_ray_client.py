"""TorchTrainer through Ray Client, ``address="ray://..."`` (issue 29, item 5).

A Ray Client server runs against the session's Ray instance as ``ray start --head``
runs one (proxy mode, with the node's runtime-env agent), on a free loopback port. A
fresh driver process (a process holds one Ray connection, and this one holds the
session's) trains digits on 2 workers with ``scaling_config={"address":
"ray://127.0.0.1:PORT"}``: its creators are defined in its ``__main__`` and reach
the workers by value through the client connection. Token authentication stays on:
the server and the driver inherit the session's ``RAY_AUTH_MODE`` and token.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.harness.cases import free_ports

DRIVER = Path(__file__).with_name("ray_client_driver.py")
#: The proxy's log, in the test's tmp_path (the fixture's and the test's are one folder).
PROXY_LOG = "client_server.log"


def _wait_for_port(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the Ray Client server exited: {log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray Client server did not listen in {timeout_s:g} s")
            time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    """The server and the per-client servers it started, by their pids."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=15)
    for member in alive:
        member.kill()


def _client_server_logs(proxy_log: Path) -> str:
    """The proxy's log and the per-client servers' logs, for a failure's message."""
    import ray

    parts = [f"\n--- proxy log ---\n{proxy_log.read_text()[-3000:]}"]
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    for log in sorted(logs_dir.glob("ray_client_server_*.*")):
        parts.append(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-2000:]}")
    return "".join(parts)


@pytest.fixture
def client_address(ray_start_4_cpus, tmp_path):
    """``ray://127.0.0.1:PORT`` of a Ray Client server in front of the session's Ray."""
    ray = ray_start_4_cpus
    node = ray._private.worker._global_node
    (port,) = free_ports(1)
    command = [
        sys.executable, "-m", "ray.util.client.server", "--mode=proxy", "--host=127.0.0.1",
        f"--port={port}", f"--address={ray.get_runtime_context().gcs_address}",
        f"--runtime-env-agent-address={node.runtime_env_agent_address}",
        f"--node-id={ray.get_runtime_context().get_node_id()}",
    ]  # fmt: skip
    log = tmp_path / PROXY_LOG
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(proc, port, log)
        yield f"ray://127.0.0.1:{port}"
    finally:
        _stop(proc)


def test_torch_trainer_trains_through_ray_client(client_address, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(DRIVER), client_address],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + _client_server_logs(tmp_path / PROXY_LOG)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["client"] is True  # connected as a Ray Client, not to the GCS directly
    stats, val = result["stats"], result["val"]
    assert stats["epoch"] == 0 and stats["num_samples"] == 1400  # one epoch, both shards
    assert math.isfinite(stats["loss"]) and 0 < stats["loss"] < 2.5
    assert 0.5 < val["val_accuracy"] <= 1.0  # the driver's creators trained on the workers
    pids = result["worker_pids"]
    assert len(set(pids)) == 2 and result["driver_pid"] not in pids  # two worker processes
    print(f"Ray Client driver: {time.monotonic() - started:.1f} s")
