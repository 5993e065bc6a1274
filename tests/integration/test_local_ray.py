"""The local Ray instance polytrain starts (issue 17, points 3 and 4).

- With no address and a stale session file left by ``ray start``, a local instance
  starts (with a warning naming the file) instead of retrying the dead cluster.
- Every socket the instance's processes listen on is bound to 127.0.0.1, and none
  answers on the host's outward address; also while a 2-worker ddp trainer runs
  (issue 31: rank 0's torch store listened on every interface).
- Ray's token authentication is on: a GCS client without the token, or with a
  wrong one, is refused; one with the token is served.
- Connecting to something that accepts TCP but is no Ray GCS raises
  ``ConnectionError`` after ``timeout_s`` instead of hanging.

All of it runs in one fresh process (tests/integration/local_ray_script.py) with a
private ``RAY_TMPDIR``, so neither the session's shared Ray instance nor anybody's
``/tmp/ray`` is touched.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("local_ray_script.py")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    # Ray's socket paths live under RAY_TMPDIR and must stay below 108 bytes: a short dir.
    tmp = Path(tempfile.mkdtemp(prefix="ptlr", dir="/tmp"))
    (tmp / "ray").mkdir()
    dead = socket.socket()
    dead.bind(("", 0))  # bound, never listening: the dead cluster's port
    stale = f"127.0.0.1:{dead.getsockname()[1]}"
    (tmp / "ray" / "ray_current_cluster").write_text(stale)
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")
    }
    env["RAY_TMPDIR"] = str(tmp)
    out = tmp_path_factory.mktemp("local_ray") / "result.json"
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        dead.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    result["stale"] = stale
    result["session_file"] = str(tmp / "ray" / "ray_current_cluster")
    return result


def test_stale_session_file_starts_a_local_instance(local_ray):
    assert local_ray["node_ip"] == "127.0.0.1"
    warning = next(m for m in local_ray["warnings"] if "session file" in m)
    assert f"{local_ray['stale']!r} comes from the session file {local_ray['session_file']}" in (
        warning
    )
    assert "Starting a local Ray instance instead" in warning


def test_every_ray_socket_is_bound_to_the_loopback(local_ray):
    sockets = local_ray["sockets"]
    processes = {s["process"] for s in sockets}
    # The servers this test is about must have been seen at all.
    assert "gcs_server" in processes and "raylet" in processes, sockets
    assert any(s["process"].startswith("ray::Probe") for s in sockets), sockets
    exposed = [
        s for s in sockets if not ipaddress.ip_address(s["ip"].removeprefix("::ffff:")).is_loopback
    ]
    assert exposed == [], exposed


def test_a_training_run_listens_on_the_loopback_only(local_ray):
    training = local_ray["training"]
    rank0 = training["workers"][0]
    assert rank0["master_addr"] == "127.0.0.1"  # the address the group was given
    # The rendezvous store was seen, in rank 0's process, on that address only.
    store = [s for s in training["sockets"] if s["port"] == rank0["master_port"]]
    assert store and {(s["pid"], s["ip"]) for s in store} == {(rank0["pid"], "127.0.0.1")}
    worker_pids = {w["pid"] for w in training["workers"]}
    assert worker_pids <= {s["pid"] for s in training["sockets"]}  # the workers were measured
    # Every listening socket of every process of the run, Ray's and the workers' (torch
    # store, gloo), on the loopback: none on 0.0.0.0, :: or an outward address.
    exposed = [
        s
        for s in training["sockets"]
        if not ipaddress.ip_address(s["ip"].removeprefix("::ffff:")).is_loopback
    ]
    assert exposed == [], exposed


def test_no_ray_port_answers_on_the_outward_address(local_ray):
    if ipaddress.ip_address(local_ray["outward_ip"]).is_loopback:
        pytest.skip("this host has no outward address")
    answered = {port: err for port, err in local_ray["outward_probes"].items() if err is None}
    assert answered == {}
    assert local_ray["outward_probes"]  # there were ports to probe


def test_token_authentication_refuses_clients_without_the_token(local_ray):
    assert local_ray["auth_mode"] == "token"
    token = local_ray["token"]
    assert token["no_token"].startswith("REFUSED AuthenticationError"), token
    assert token["wrong_token"].startswith("REFUSED AuthenticationError"), token
    assert token["right_token"].startswith("OK b'session_"), token


def test_connecting_to_a_silent_port_gives_up_after_timeout(local_ray):
    bounded = local_ray["bounded_connect"]
    assert bounded["raised"] is not None, bounded
    assert f"address='{bounded['address']}'" in bounded["raised"]
    assert "within 5 s" in bounded["raised"]
