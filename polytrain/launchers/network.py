"""Which network interface a worker's collectives bind to.

torch's gloo takes its own address from the host name unless ``GLOO_SOCKET_IFNAME``
names an interface; on hosts whose name resolves to a loopback address (many
Debian/Ubuntu images map it to 127.0.1.1) cross-node gloo then fails. The
interface to use is the one that holds the address Ray reaches the worker's node
on: that address routes to the other nodes. Interface names can differ between
hosts, so the lookup runs in the worker, on its own host.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

#: The variables that pick the interface of gloo (torch, and Horovod's own gloo).
GLOO_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
#: The variable that picks NCCL's bootstrap and socket-transport interface.
NCCL_IFNAME_VAR = "NCCL_SOCKET_IFNAME"


def _parse(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def _network(address: str, netmask: str | None) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    host = address.split("%", 1)[0]
    try:
        return ipaddress.ip_network(f"{host}/{netmask}", strict=False)
    except (TypeError, ValueError):
        return ipaddress.ip_network(host)


def interface_with_address(ip: str) -> str | None:
    """The name of this host's network interface that holds ``ip`` (IPv4 or IPv6), if any.

    An interface that has ``ip`` as one of its addresses wins; otherwise the one whose
    subnet contains it (127.0.0.2 is on ``lo``, whose address is 127.0.0.1/8).

    Example:
        >>> interface_with_address("127.0.0.1")
        'lo'
    """
    import psutil

    target = _parse(ip)
    if target is None:
        return None
    in_subnet = None
    for iface, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            own = _parse(addr.address)
            if own == target:
                return iface
            if in_subnet is None and own is not None and own.version == target.version:
                if target in _network(addr.address, addr.netmask):
                    in_subnet = iface
    return in_subnet


def socket_ifname_env(
    node_ip: str, user_env: Mapping[str, str], use_gpu: bool = False
) -> dict[str, str]:
    """The interface variables to set for a worker whose node is reached at ``node_ip``.

    Gives ``GLOO_SOCKET_IFNAME`` and ``HOROVOD_GLOO_IFACE`` (and ``NCCL_SOCKET_IFNAME``
    when ``use_gpu``), each naming the interface of this host that holds
    ``node_ip``, but only the variables that ``user_env`` does not set already: a
    value the user chose is never overridden. Empty when no interface holds
    ``node_ip`` (the libraries' own defaults apply then).

    Args:
        node_ip: the worker's node address as Ray reports it.
        user_env: the environment the worker already has (its ``os.environ``).
        use_gpu: also pick NCCL's interface.
    """
    iface = interface_with_address(node_ip)
    if iface is None:
        return {}
    names = GLOO_IFNAME_VARS + ((NCCL_IFNAME_VAR,) if use_gpu else ())
    return {name: iface for name in names if not user_env.get(name)}


def apply_socket_ifname_env(node_ip: str, use_gpu: bool = False) -> dict[str, str]:
    """Worker: set :func:`socket_ifname_env` in this process's environment; return what was set.

    Call it in the worker process before the process group (or ``hvd.init()``)
    starts; variables already in ``os.environ`` (the user's ``env_vars``, the
    runtime env, the node's own environment) are left as they are.
    """
    env = socket_ifname_env(node_ip, os.environ, use_gpu)
    os.environ.update(env)
    return env
