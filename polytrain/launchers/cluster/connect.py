"""Connecting the driver to Ray, and what the cluster can hold right now.

Three things make a plain ``ray.init`` hang instead of failing, and are handled here:

- Ray rewrites a ``127.0.0.1:port`` / ``localhost:port`` address to this host's
  outward address before dialling it, so a head that listens on the loopback only
  is never reached (``ray.init`` retries for many minutes). The address Ray will
  dial is checked instead of the one given; when only the loopback answers, the
  driver connects over the loopback.
- With no address, ``ray.init`` connects to the cluster named in the session file
  an earlier ``ray start`` left behind (``<ray tmp>/ray_current_cluster``), even when
  that cluster is gone. ``address=None`` then starts a local instance (with a
  warning naming the stale file); ``address="auto"`` fails at once naming it.
- Whatever still hangs (something that accepts TCP connections but is no Ray
  GCS) is bounded by ``timeout_s``.

A Ray Client proxy (``ray://``) whose server process for this driver died at start-up
is asked once more within the same bound: it starts a fresh server for a new client.

A local instance listens on 127.0.0.1 only (its GCS, raylet, object manager,
workers, dashboard and runtime-env agents), and Ray's token authentication stays
as Ray sets it up (on by default in Ray 2.60).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray

logger = logging.getLogger(__name__)

#: Seconds a TCP probe of the cluster address may take.
PROBE_TIMEOUT_S = 5.0
#: The shortest bound put on ``ray.init`` when connecting (a start_timeout_s of 0 is no bound).
MIN_CONNECT_TIMEOUT_S = 5.0

_LOCAL_NAMES = ("local",)


@dataclass(frozen=True)
class RayTarget:
    """The cluster ``ray.init`` would connect to, and where that address came from.

    Attributes:
        given: the address as the caller gave it (None, "auto", "host:port", "ray://...").
        dial: the ``host:port`` Ray dials (after its loopback rewrite), or None to start
            a local instance.
        loopback: the address as given when it names this host's loopback (else None).
        source: "argument", "RAY_ADDRESS", "session file" or "running GCS".
        session_file: the session file's path when ``source`` is "session file".
        recorded: the address as the source gives it, before Ray's rewrite.
    """

    given: str | None
    dial: str | None
    loopback: str | None = None
    source: str = "argument"
    session_file: str | None = None
    recorded: str | None = None


def resolve_target(address: str | None) -> RayTarget:
    """Where ``ray.init(address=address)`` would connect, without connecting.

    Follows Ray's own rules (``RAY_ADDRESS``, the session file of ``ray start``, the
    loopback rewrite) so that the address checked is the one Ray dials.

    Raises:
        ConnectionError: ``address="auto"`` and no cluster is known on this host, or
            the address cannot be parsed.
    """
    from ray._common.utils import get_ray_address_file
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private.utils import read_ray_address

    if address in _LOCAL_NAMES:
        return RayTarget(given=address, dial=None)
    if address is not None and "://" in address:  # Ray Client: dialled as given
        return RayTarget(given=address, dial=address.split("://", 1)[1].rstrip("/"))
    env_address = os.environ.get("RAY_ADDRESS") or None
    implicit = address in (None, "auto")
    try:
        dial = canonicalize_bootstrap_address(address)
    except Exception as exc:  # noqa: BLE001 - ConnectionError ("auto", none found), ValueError
        raise ConnectionError(
            f"Could not find a Ray cluster at address={address!r} ({exc}). Start one with "
            f"`ray start --head`, or pass address=None to start a local instance."
        ) from None
    if dial is None:
        return RayTarget(given=address, dial=None)
    if implicit and env_address:
        source, literal, session_file = "RAY_ADDRESS", env_address, None
    elif implicit and read_ray_address() is not None:
        session_file = get_ray_address_file(None)
        source, literal = "session file", read_ray_address()
    elif implicit:
        source, literal, session_file = "running GCS", dial, None
    else:
        source, literal, session_file = "argument", address, None
    return RayTarget(address, dial, _loopback_form(literal), source, session_file, literal)


def _loopback_form(address: str | None) -> str | None:
    from ray._common.network_utils import is_localhost, parse_address

    parsed = parse_address(address) if address else None
    return address if parsed is not None and is_localhost(parsed[0]) else None


def probe(hostport: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Open (and close) a TCP connection to ``host:port``; the error text, or None when it answers."""
    from ray._common.network_utils import parse_address

    parsed = parse_address(hostport)
    if parsed is None or not parsed[1].isdigit():
        return f"{hostport!r} is not host:port"
    try:
        with socket.create_connection((parsed[0], int(parsed[1])), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def plan_connection(address: str | None) -> tuple[str, RayTarget]:
    """Decide how :func:`ensure_ray` reaches Ray, probing the address Ray would dial.

    Returns:
        ``(how, target)``: how is "local" (start a local instance), "connect" (dial
        ``target.dial``) or "loopback" (the head answers on 127.0.0.1 only: connect
        there, keeping Ray from rewriting the address).

    Raises:
        ConnectionError: nothing answers at the address Ray would dial, naming it (and
            the stale session file when the address came from one, with
            ``address="auto"``). With ``address=None`` a stale session file gives
            "local" and a warning instead.
    """
    target = resolve_target(address)
    if target.dial is None:
        return "local", target
    error = probe(target.dial)
    if error is None:
        return "connect", target
    if target.loopback is not None and target.loopback != target.dial:
        if probe(target.loopback) is None:  # a head listening on the loopback only
            return "loopback", target
    if target.source == "session file" and address is None:
        logger.warning(_stale_message(target, error) + " Starting a local Ray instance instead.")
        return "local", target
    raise ConnectionError(_unreachable_message(target, error))


def ensure_ray(
    address: str | None = None, runtime_env: dict | None = None, timeout_s: float = 30.0
) -> None:
    """Connect to Ray: the running instance, ``address``, or a new local one.

    ``address=None`` connects to the cluster ``ray start`` started on this host (or
    ``RAY_ADDRESS``), else starts a local instance; ``"auto"`` requires an existing
    cluster; ``"local"`` always starts a local instance; ``"host:port"`` connects
    there. A new local instance has no dashboard and listens on 127.0.0.1 only.
    ``runtime_env`` applies to every worker of this driver (e.g. PYTHONPATH for
    creators given by import path).

    Args:
        address: the cluster address, see above.
        runtime_env: Ray runtime environment of this driver's workers.
        timeout_s: connecting to an existing cluster fails after this many seconds
            (at least :data:`MIN_CONNECT_TIMEOUT_S`); pass ``start_timeout_s``.

    Raises:
        ConnectionError: within seconds when nothing answers at the address Ray would
            dial (see :func:`plan_connection`), when connecting takes longer than
            ``timeout_s``, or when a local instance fails to start.
    """
    if ray.is_initialized():
        return
    how, target = plan_connection(address)
    if how == "local":
        _start_local(runtime_env)
    else:
        _connect(target, runtime_env, timeout_s, via_loopback=how == "loopback")


def _rewrite_note(target: RayTarget) -> str:
    if target.loopback is None or target.loopback == target.dial:
        return ""
    return (
        f" (Ray dials {target.dial}: it replaces 127.0.0.1 / localhost by this host's "
        f"address before connecting; the loopback did not answer either)"
    )


def _stale_message(target: RayTarget, error: str) -> str:
    return (
        f"The Ray address {target.recorded!r} comes from the session file "
        f"{target.session_file}, left by an earlier `ray start`, but nothing answers at "
        f"{target.dial} ({error}): that cluster is gone. Start it again (`ray start --head`) "
        f"or delete {target.session_file}."
    )


def _unreachable_message(target: RayTarget, error: str) -> str:
    if target.source == "session file":
        return (
            f"Could not connect to Ray at address={target.given!r}. "
            + _stale_message(target, error)
            + " Or pass address=None to start a local instance."
        )
    if target.source == "RAY_ADDRESS":
        return (
            f"Could not connect to Ray at RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}: "
            f"nothing answers at {target.dial}{_rewrite_note(target)} ({error}). Fix or "
            f"unset the RAY_ADDRESS environment variable."
        )
    return (
        f"Could not connect to Ray at address={target.given!r}: nothing answers at "
        f"{target.dial}{_rewrite_note(target)} ({error}). Check the address (`ray status` on "
        f"the head node shows it), or pass address=None to start a local instance."
    )


@contextlib.contextmanager
def loopback_stays_loopback() -> Iterator[None]:
    """Within this block Ray keeps 127.0.0.1 as this node's address instead of the outward one.

    Ray replaces a loopback node or cluster address by the host's outward address
    unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off (its macOS / Windows default),
    read when ``ray.init`` resolves addresses. A node whose address is 127.0.0.1 makes
    Ray bind its gRPC servers and agents to 127.0.0.1 only.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _start_local(runtime_env: dict | None) -> None:
    try:
        with loopback_stays_loopback():
            ray.init(
                address="local",
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=True,
                configure_logging=False,
                runtime_env=runtime_env,
            )
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a start times out
        raise ConnectionError(
            f"Could not start a local Ray instance ({type(exc).__name__}: {exc})."
        ) from exc


class _DropNotMainThreadWarning(logging.Filter):
    """ray.init in a helper thread warns that it cannot set a SIGTERM handler; expected here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


#: What a Ray Client proxy answers when the server process it starts for one client died
#: at start-up; the proxy starts a fresh one, on another port, for the next client. The
#: proxy reports it in one of two ways: its own message when it sees the process gone,
#: or psutil's ``ZombieProcess`` when the process exits between the proxy's liveness
#: check and its read of the command line (proxier.py's ``start_specific_server``).
CLIENT_SERVER_START_FAILED = ("Starting Ray client server failed", "psutil.ZombieProcess")


def _client_server_start_failed(target: RayTarget, exc: BaseException | None) -> bool:
    """Whether ``exc`` is a Ray Client proxy's report that its per-client server died starting."""
    return (
        isinstance(exc, ConnectionAbortedError)
        and any((a or "").startswith("ray://") for a in (target.given, target.recorded))
        and any(report in str(exc) for report in CLIENT_SERVER_START_FAILED)
    )


def _connect(
    target: RayTarget, runtime_env: dict | None, timeout_s: float, via_loopback: bool
) -> None:
    """``ray.init`` on a helper thread, given up after ``timeout_s`` (it may hang for minutes).

    A Ray Client proxy whose server process for this client died at start-up is asked
    once more within the same bound (a new client gets a new server process); the
    warning names the proxy's error.
    """
    bound = max(timeout_s, MIN_CONNECT_TIMEOUT_S)
    deadline = time.monotonic() + bound
    route = f"over the loopback, {target.loopback}" if via_loopback else f"Ray dials {target.dial}"
    where = f"address={target.given!r} ({route})"
    outcome = _init_once(target, runtime_env, bound, via_loopback)
    remaining = deadline - time.monotonic()
    if _client_server_start_failed(target, outcome.get("error")) and remaining > 1.0:
        logger.warning(
            "The Ray Client server at %s could not start a server process for this driver "
            "(%s); connecting once more.",
            where,
            str(outcome["error"]).strip().splitlines()[-1],
        )
        outcome = _init_once(target, runtime_env, remaining, via_loopback)
    if outcome["gave_up"]:
        raise ConnectionError(
            f"Could not connect to Ray at {where} within {bound:g} s: something answers "
            f"there but the connection did not complete. Check that it is a Ray head's GCS "
            f"port (`ray status` on the head shows it), or raise start_timeout_s."
        )
    if "error" in outcome:
        exc = outcome["error"]
        raise ConnectionError(
            f"Could not connect to Ray at {where} ({type(exc).__name__}: {exc}). Check that "
            f"the cluster is up (`ray status`), or pass address=None to start a local instance."
        ) from exc


def _init_once(
    target: RayTarget, runtime_env: dict | None, bound_s: float, via_loopback: bool
) -> dict[str, Any]:
    """One ``ray.init`` on a helper thread, waited for ``bound_s``: connected, error or gave_up."""
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        context = loopback_stays_loopback() if via_loopback else contextlib.nullcontext()
        try:
            with context:
                ray.init(address=target.given, log_to_driver=True, runtime_env=runtime_env)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
            return
        with lock:
            outcome["connected"] = True
            if outcome.get("gave_up"):  # connected after the caller gave up: detach again
                ray.shutdown()

    worker_logger = logging.getLogger("ray._private.worker")
    log_filter = _DropNotMainThreadWarning()
    worker_logger.addFilter(log_filter)
    thread = threading.Thread(target=run, name="polytrain-ray-init", daemon=True)
    try:
        thread.start()
        thread.join(bound_s)
        with lock:
            outcome["gave_up"] = thread.is_alive() and not outcome.get("connected")
    finally:
        worker_logger.removeFilter(log_filter)
    return outcome


def placeable_bundles(bundle: dict[str, float], excluded_nodes: Iterable[str] = ()) -> int:
    """How many more copies of ``bundle`` the cluster's free resources hold now.

    ``excluded_nodes`` (Ray node ids, e.g. draining nodes) are not counted: Ray
    schedules nothing new on a draining node but still counts its free resources
    as available, so a group sized by them would wait for room that never comes.
    """
    excluded = frozenset(excluded_nodes)
    if excluded:
        return placeable_outside(
            bundle, excluded, ray._private.state.available_resources_per_node()
        )
    available = ray.available_resources()
    return int(min(available.get(k, 0.0) // v for k, v in bundle.items() if v > 0))


def placeable_outside(
    bundle: Mapping[str, float],
    excluded: Iterable[str],
    available: Mapping[str, Mapping[str, float]],
) -> int:
    """How many copies of ``bundle`` the free resources of the nodes not in ``excluded`` hold.

    ``available``: ``{node_id: {resource: free amount}}`` (Ray's
    ``available_resources_per_node()``). Counted per node: a bundle never spans nodes.
    """
    skip = set(excluded)
    total = 0
    for node_id, free in available.items():
        if node_id in skip:
            continue
        fits = [free.get(k, 0.0) // v for k, v in bundle.items() if v > 0]
        total += int(min(fits)) if fits else 0
    return total


def format_resources(resources: dict[str, float]) -> str:
    """Ray resources for a message: CPU, GPU, memory in GiB and custom resources, no node tags."""
    keep = {
        k: v
        for k, v in resources.items()
        if k in ("CPU", "GPU", "memory") or not k.startswith("node:")
    }
    keep.pop("object_store_memory", None)
    if "memory" in keep:
        keep["memory"] = f"{keep['memory'] / 2**30:.1f} GiB"
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(keep.items())
    )
