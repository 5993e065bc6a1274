"""Interface selection for gloo / Horovod / NCCL (issue 17, point 2), without Ray."""

from __future__ import annotations

import os
import socket
import sys

import psutil
import pytest

from polytrain.launchers.network import (
    apply_socket_ifname_env,
    interface_with_address,
    socket_ifname_env,
)

# TEST-NET-3 (RFC 5737): never assigned to a real interface.
MADE_UP_IP = "203.0.113.77"

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the loopback interface is 'lo' on Linux"
)


def _has_address(iface: str, family: int, address: str) -> bool:
    return any(
        a.family == family and a.address.split("%")[0] == address
        for a in psutil.net_if_addrs().get(iface, [])
    )


@linux_only
def test_loopback_address_is_on_lo():
    assert interface_with_address("127.0.0.1") == "lo"


@linux_only
def test_other_loopback_addresses_are_on_lo():
    # lo holds 127.0.0.1/8: the simulated nodes of the multi-node tests live there.
    assert interface_with_address("127.0.0.2") == "lo"
    assert interface_with_address("127.0.0.3") == "lo"
    assert socket_ifname_env("127.0.0.3", {})["GLOO_SOCKET_IFNAME"] == "lo"


@linux_only
def test_ipv6_loopback_is_on_lo():
    if not _has_address("lo", socket.AF_INET6, "::1"):
        pytest.skip("lo has no IPv6 address here")
    assert interface_with_address("::1") == "lo"
    assert interface_with_address("0:0:0:0:0:0:0:1") == "lo"  # compared as addresses


def test_every_address_of_this_host_maps_to_its_interface():
    for iface, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET:
                found = interface_with_address(addr.address)
                # Two interfaces may share an address; the one found must hold it.
                assert found is not None and _has_address(found, socket.AF_INET, addr.address), (
                    iface,
                    addr.address,
                )


def test_unknown_or_malformed_address_has_no_interface():
    assert interface_with_address(MADE_UP_IP) is None
    assert interface_with_address("not-an-ip") is None


@linux_only
def test_env_names_the_interface_for_gloo_and_horovod():
    assert socket_ifname_env("127.0.0.1", {}) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "HOROVOD_GLOO_IFACE": "lo",
    }
    assert socket_ifname_env("127.0.0.1", {}, use_gpu=True) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "HOROVOD_GLOO_IFACE": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }


@linux_only
def test_env_never_overrides_what_the_user_set():
    user = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "^docker0"}
    assert socket_ifname_env("127.0.0.1", user, use_gpu=True) == {"HOROVOD_GLOO_IFACE": "lo"}
    everything = {
        "GLOO_SOCKET_IFNAME": "a",
        "HOROVOD_GLOO_IFACE": "b",
        "NCCL_SOCKET_IFNAME": "c",
    }
    assert socket_ifname_env("127.0.0.1", everything, use_gpu=True) == {}


def test_env_is_empty_when_no_interface_holds_the_address():
    assert socket_ifname_env(MADE_UP_IP, {}, use_gpu=True) == {}


@linux_only
def test_apply_sets_only_missing_variables_in_this_process(monkeypatch):
    fake_environ = {"GLOO_SOCKET_IFNAME": "users-choice", "PATH": os.environ.get("PATH", "")}
    monkeypatch.setattr(os, "environ", fake_environ)
    applied = apply_socket_ifname_env("127.0.0.1")
    assert applied == {"HOROVOD_GLOO_IFACE": "lo"}
    assert fake_environ["GLOO_SOCKET_IFNAME"] == "users-choice"
    assert fake_environ["HOROVOD_GLOO_IFACE"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in fake_environ
