"""Where a fresh local ``ray.init`` spends its time, phase by phase.

Wraps the Ray functions a local start runs one after another (the GCS server, the
API server and its wait for its address, the raylet with its agents, the wait for the
raylet's registration, the driver's connection) with wall-clock timers, runs the same
``ray.init`` that polytrain's trainers run when no cluster is up
(:func:`polytrain.launchers.cluster.connect.ensure_ray`), and prints one JSON line.

Usage: python benchmarks/drivers/ray_start_profile.py
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

_START = time.perf_counter()

import ray  # noqa: E402
from ray._private import node, services, worker  # noqa: E402

from polytrain.launchers.cluster.connect import ensure_ray  # noqa: E402

#: (object, attribute, phase name) of the timed steps of a local head's start.
TIMED = (
    (node.Node, "start_gcs_server", "GCS server"),
    (node.Node, "start_api_server", "API server (start + wait for its address)"),
    (node.Node, "start_ray_processes", "raylet + agents (start)"),
    (services, "get_node", "raylet registered (wait)"),
    (worker, "connect", "driver connects (core worker)"),
)


def _timed(phases: dict[str, float], name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def main() -> None:
    """Time one local start and print its phases (seconds) as JSON."""
    phases: dict[str, float] = {}
    for owner, attribute, name in TIMED:
        setattr(owner, attribute, _timed(phases, name, getattr(owner, attribute)))
    imported = time.perf_counter()
    ensure_ray()
    total = time.perf_counter() - imported
    phases["other (session dirs, ports, reaper, config)"] = total - sum(phases.values())
    print(
        json.dumps(
            {
                "import_ray_s": round(imported - _START, 3),
                "ray_init_s": round(total, 3),
                "phases_s": {k: round(v, 3) for k, v in phases.items()},
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
