"""Connecting fails fast for every address form (issue 17, point 3), without starting Ray.

:func:`plan_connection` decides what :func:`ensure_ray` does and raises before
``ray.init`` is ever called, so these tests run with or without a Ray instance in
the test process. Sockets stand in for Ray heads: one bound but not listening is
an address nobody answers at.
"""

from __future__ import annotations

import logging
import socket

import pytest

from polytrain.launchers.cluster.connect import plan_connection, probe, resolve_target


def _outward_ip() -> str:
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


needs_rewrite = pytest.mark.skipif(
    _outward_ip() == "127.0.0.1", reason="Ray does not rewrite loopback addresses on this host"
)


@pytest.fixture
def dead_port():
    """A port bound on every interface that nobody listens on: connections are refused."""
    sock = socket.socket()
    sock.bind(("", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def loopback_listener():
    """A port that answers on 127.0.0.1 only, like a head started with --node-ip-address=127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def session_dir(tmp_path, monkeypatch):
    """A private Ray temp dir (RAY_TMPDIR), as if `ray start` had written its session file there."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # No Ray processes on this host: with one running (the suite's own instance),
    # Ray's legacy "auto" rule would dial that GCS instead of the session file.
    import ray._private.services

    monkeypatch.setattr(ray._private.services, "find_gcs_addresses", lambda: [])
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def test_probe_tells_answering_from_refused(loopback_listener, dead_port):
    assert probe(f"127.0.0.1:{loopback_listener}") is None
    assert "refused" in probe(f"127.0.0.1:{dead_port}").lower()
    assert "not host:port" in probe("no-port-here")


def test_address_forms_resolve_to_what_ray_dials(dead_port):
    assert resolve_target("local").dial is None
    assert resolve_target(f"ray://10.1.2.3:{dead_port}").dial == f"10.1.2.3:{dead_port}"
    given = resolve_target(f"10.1.2.3:{dead_port}")
    assert (given.dial, given.loopback, given.source) == (f"10.1.2.3:{dead_port}", None, "argument")
    for host in ("127.0.0.1", "localhost"):
        target = resolve_target(f"{host}:{dead_port}")
        assert target.dial == f"{_outward_ip()}:{dead_port}"
        assert target.loopback == f"{host}:{dead_port}"


@needs_rewrite
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_unreachable_loopback_address_fails_naming_the_dialled_one(host, dead_port):
    with pytest.raises(ConnectionError) as info:
        plan_connection(f"{host}:{dead_port}")
    message = str(info.value)
    assert f"Could not connect to Ray at address='{host}:{dead_port}'" in message
    assert f"Ray dials {_outward_ip()}:{dead_port}" in message
    assert "address=None to start a local instance" in message


def test_unreachable_remote_address_fails(dead_port):
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{dead_port}"):
        plan_connection(f"ray://127.0.0.1:{dead_port}")


@needs_rewrite
def test_head_on_the_loopback_only_is_reached_over_the_loopback(loopback_listener):
    # Ray would dial the outward address, where nothing answers, and retry for minutes.
    how, target = plan_connection(f"127.0.0.1:{loopback_listener}")
    assert how == "loopback"
    assert target.dial == f"{_outward_ip()}:{loopback_listener}"


def test_head_on_every_interface_is_dialled_as_ray_does():
    sock = socket.socket()
    sock.bind(("", 0))
    sock.listen()
    try:
        port = sock.getsockname()[1]
        assert plan_connection(f"127.0.0.1:{port}")[0] == "connect"
    finally:
        sock.close()


def test_stale_session_file_starts_local_with_no_address(session_dir, dead_port, caplog):
    (session_dir / "ray_current_cluster").write_text(f"127.0.0.1:{dead_port}")
    with caplog.at_level(logging.WARNING, logger="polytrain.launchers.cluster.connect"):
        how, target = plan_connection(None)
    assert how == "local"
    assert target.source == "session file"
    warning = caplog.text
    assert f"'127.0.0.1:{dead_port}' comes from the session file" in warning
    assert str(session_dir / "ray_current_cluster") in warning
    assert "Starting a local Ray instance instead" in warning


def test_stale_session_file_fails_fast_with_auto(session_dir, dead_port):
    (session_dir / "ray_current_cluster").write_text(f"127.0.0.1:{dead_port}")
    with pytest.raises(ConnectionError) as info:
        plan_connection("auto")
    message = str(info.value)
    assert "Could not connect to Ray at address='auto'" in message
    assert f"delete {session_dir / 'ray_current_cluster'}" in message
    assert "that cluster is gone" in message


def test_live_session_file_is_connected_to(session_dir):
    sock = socket.socket()
    sock.bind(("", 0))
    sock.listen()
    try:
        (session_dir / "ray_current_cluster").write_text(f"127.0.0.1:{sock.getsockname()[1]}")
        assert plan_connection(None)[0] == "connect"
        assert plan_connection("auto")[0] == "connect"
    finally:
        sock.close()


def test_no_session_file_and_no_address_starts_local(session_dir):
    assert plan_connection(None)[0] == "local"
    assert plan_connection("local")[0] == "local"


def test_dead_ray_address_variable_is_named(session_dir, dead_port, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{dead_port}")
    for address in (None, "auto"):
        with pytest.raises(ConnectionError) as info:
            plan_connection(address)
        assert f"RAY_ADDRESS='127.0.0.1:{dead_port}'" in str(info.value)
        assert "unset the RAY_ADDRESS environment variable" in str(info.value)


def test_malformed_address_is_a_connection_error():
    with pytest.raises(ConnectionError, match="address='not an address'"):
        plan_connection("not an address")


_SERVER_START_FAILED = ConnectionAbortedError(
    "Initialization failure from server:\nTraceback (most recent call last):\n"
    '  File "proxier.py", line 772, in Datapath\n    raise RuntimeError(\n'
    "RuntimeError: Starting Ray client server failed. See ray_client_server_23000.err "
    "for detailed logs.\n"
)

#: The same death seen in the other order: the process exits between the proxy's
#: ``poll()`` and its ``cmdline()`` read (CI, 2026-11-28).
_SERVER_START_ZOMBIE = ConnectionAbortedError(
    "Initialization failure from server:\nTraceback (most recent call last):\n"
    '  File "proxier.py", line 396, in start_specific_server\n'
    "    cmd = psutil_proc.cmdline()\n"
    "psutil.ZombieProcess: PID still exists but it's a zombie (pid=21974)\n"
)


class _ScriptedInit:
    """Stands in for ``ray.init``: raises the scripted errors in turn, then connects."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def _client_target():
    from polytrain.launchers.cluster.connect import RayTarget

    return RayTarget(given="ray://127.0.0.1:10001", dial="127.0.0.1:10001")


@pytest.mark.parametrize(
    "source, report",
    [
        ("argument", _SERVER_START_FAILED),
        ("RAY_ADDRESS", _SERVER_START_FAILED),
        ("argument", _SERVER_START_ZOMBIE),
    ],
    ids=["argument", "RAY_ADDRESS", "zombie-report"],
)
def test_a_client_server_that_died_starting_is_asked_once_more(
    monkeypatch, caplog, source, report
):
    from polytrain.launchers.cluster import connect

    init = _ScriptedInit(report)
    monkeypatch.setattr(connect.ray, "init", init)
    target = _client_target()
    if source == "RAY_ADDRESS":  # address=None, RAY_ADDRESS=ray://...
        target = connect.RayTarget(None, target.dial, source=source, recorded=target.given)
    with caplog.at_level(logging.WARNING, logger=connect.__name__):
        connect._connect(target, None, timeout_s=10, via_loopback=False)
    assert init.calls == 2
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "connecting once more" in warning
    assert str(report).strip().splitlines()[-1] in warning  # the proxy's own words


def test_a_client_server_failing_twice_is_a_connection_error_naming_the_proxys_error(
    monkeypatch,
):
    from polytrain.launchers.cluster import connect

    init = _ScriptedInit(_SERVER_START_FAILED, _SERVER_START_FAILED, _SERVER_START_FAILED)
    monkeypatch.setattr(connect.ray, "init", init)
    with pytest.raises(ConnectionError, match="Starting Ray client server failed") as info:
        connect._connect(_client_target(), None, timeout_s=10, via_loopback=False)
    assert init.calls == 2  # one retry, not a loop
    assert "address='ray://127.0.0.1:10001'" in str(info.value)


@pytest.mark.parametrize(
    "given, error",
    [
        (
            "ray://127.0.0.1:10001",
            ConnectionAbortedError("Initialization failure: bad runtime_env"),
        ),
        ("127.0.0.1:6379", _SERVER_START_FAILED),  # not a Ray Client address
    ],
    ids=["other-client-error", "gcs-address"],
)
def test_other_connection_errors_are_not_retried(monkeypatch, given, error):
    from polytrain.launchers.cluster import connect

    init = _ScriptedInit(error)
    monkeypatch.setattr(connect.ray, "init", init)
    target = connect.RayTarget(given=given, dial=given.removeprefix("ray://"))
    with pytest.raises(ConnectionError):
        connect._connect(target, None, timeout_s=10, via_loopback=False)
    assert init.calls == 1


@pytest.mark.parametrize("given", [None, "auto", "127.0.0.1:6379", "ray://127.0.0.1:10001"])
def test_a_connection_that_succeeds_is_made_once_whatever_the_address(monkeypatch, given):
    """``given`` is None when the address comes from RAY_ADDRESS or a session file."""
    from polytrain.launchers.cluster import connect

    init = _ScriptedInit()
    monkeypatch.setattr(connect.ray, "init", init)
    connect._connect(
        connect.RayTarget(given=given, dial="127.0.0.1:6379"),
        None,
        timeout_s=10,
        via_loopback=False,
    )
    assert init.calls == 1
