"""Connecting the driver to Ray, and what the cluster can hold right now."""

from __future__ import annotations

import socket

import ray


def ensure_ray(address: str | None = None, runtime_env: dict | None = None) -> None:
    """Connect to Ray: the running instance, ``address``, or a new local one.

    A new local instance has no dashboard and binds to 127.0.0.1. ``runtime_env``
    applies to every worker of this driver (e.g. PYTHONPATH for creators given by
    import path).

    Raises:
        ConnectionError: ``address`` cannot be reached (naming it), or Ray fails to start.
    """
    if ray.is_initialized():
        return
    from ray._private.services import canonicalize_bootstrap_address

    _check_reachable(address)

    try:
        existing = canonicalize_bootstrap_address(address)
    except Exception as exc:  # noqa: BLE001 - e.g. "auto" with no cluster running
        raise ConnectionError(
            f"Could not find a Ray cluster at address={address!r} ({exc}). Start one with "
            f"`ray start --head`, or pass address=None to start a local instance."
        ) from exc
    try:
        if existing is None:
            ray.init(
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=True,
                configure_logging=False,
                runtime_env=runtime_env,
            )
        else:
            ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a start times out
        raise ConnectionError(
            f"Could not connect to Ray at address={address!r} ({type(exc).__name__}: {exc}). "
            f"Check that the cluster is up (`ray status`), or pass address=None to start a "
            f"local instance."
        ) from exc


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail at once on a ``host:port`` nobody listens on (ray.init would retry for minutes)."""
    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # let Ray parse and reject it
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"Could not connect to Ray at address={address!r}: nothing answers at "
            f"{host}:{port} ({exc}). Check the address (`ray status` on the head node shows "
            f"it), or pass address=None to start a local instance."
        ) from None


def placeable_bundles(bundle: dict[str, float]) -> int:
    """How many more copies of ``bundle`` the cluster's free resources hold now."""
    available = ray.available_resources()
    return int(min(available.get(k, 0.0) // v for k, v in bundle.items() if v > 0))
