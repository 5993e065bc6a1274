"""Ray-side helpers of the worker group: feasibility and placement errors, failure reports.

Ray is imported inside the functions, which only a Ray worker group calls: the
scaling policies import this module, and a process without Ray (local mode under
``torchrun``, the GPU check's node) imports those.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polytrain.errors import (
    InsufficientResourcesError,
    WorkerDiedError,
    WorkerError,
    WorkerHangError,
    worker_error_like,
)
from polytrain.launchers.cluster import autoscaler
from polytrain.launchers.ranks import WorkerMetadata

__all__ = [
    "check_feasible",
    "classify_failure",
    "describe_failure",
    "not_placed_error",
    "request_workers",
    "trial_placement_group",
    "wait_until_placed",
]

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def describe_failure(exc: BaseException, rank: int, meta: WorkerMetadata | None) -> WorkerError:
    """A failed Ray call of worker ``rank`` as a :class:`WorkerError` (or :class:`WorkerDiedError`)."""
    from ray.exceptions import RayActorError, RayTaskError

    where = f" (pid {meta.pid} on {meta.node_ip})" if meta else ""
    if isinstance(exc, RayActorError):
        return WorkerDiedError(
            f"Worker rank {rank}{where} died: {exc}", rank=rank, remote_traceback=str(exc)
        )
    if isinstance(exc, RayTaskError):
        cause = exc.as_instanceof_cause()
        remote_tb = _ANSI_ESCAPE.sub("", str(exc))
        # Also an instance of the user's exception class, so `except ValueError` still works.
        error = worker_error_like(
            exc.cause,
            f"Worker rank {rank}{where} raised {exc.cause.__class__.__name__}: {exc.cause}\n\n"
            f"Remote traceback (rank {rank}):\n{remote_tb}",
            rank=rank,
            remote_traceback=remote_tb,
        )
        error.__cause__ = cause
        return error
    return WorkerError(f"Worker rank {rank}{where} failed: {exc!r}", rank=rank)


def trial_placement_group(num_workers: int) -> Any:
    """The placement group this process runs in, if it has a bundle per worker; else None.

    A Ray Tune trial's PlacementGroupFactory reserves the trainable's bundle and
    one per worker: a worker group started in the trial fills its last
    ``num_workers`` bundles (a new placement group could never be placed while the
    trial holds the resources).
    """
    import ray

    current = ray.util.get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= num_workers:
        return current
    return None


def check_feasible(bundle: dict[str, float], requested: str) -> None:
    """Raise if no node of the cluster could ever hold one ``bundle``.

    Raises:
        InsufficientResourcesError: naming the resource, the cluster's and what to do.
    """
    import ray

    from polytrain.launchers.cluster.connect import format_resources

    total = ray.cluster_resources()
    for resource, amount in bundle.items():
        if total.get(resource, 0.0) < amount:
            raise InsufficientResourcesError(
                f"Requested {requested}, but the Ray cluster has "
                f"{total.get(resource, 0.0):g} {resource} in total, so no worker can "
                f"ever be placed. Cluster resources: {format_resources(total)}. "
                + (
                    "Set use_gpu=False or add GPU nodes."
                    if resource == "GPU"
                    else "Lower the per-worker resources or add nodes."
                )
            )


def not_placed_error(requested: str, start_timeout_s: float) -> InsufficientResourcesError:
    """The error for workers not placed in time, with the cluster's free and total resources."""
    import ray

    from polytrain.launchers.cluster.connect import format_resources

    available = ray.available_resources()
    total = ray.cluster_resources()
    return InsufficientResourcesError(
        f"Could not place {requested} within start_timeout_s="
        f"{start_timeout_s:g}s. Available now: {format_resources(available)}; cluster total: "
        f"{format_resources(total)}. Lower num_workers or the per-worker resources, free the "
        f"cluster, add nodes, or raise start_timeout_s."
    )


def wait_until_placed(
    ready: Any,
    start_timeout_s: float,
    bundle: dict[str, float],
    num_workers: int,
    shape: autoscaler.ClusterShape | None,
) -> bool:
    """Wait for a placement group's ``ready()`` ref; True once placed, False on timeout.

    With an autoscaler (``shape``), new nodes may have to start first: the wait is
    longer (see :func:`autoscaler.start_timeout`) and prints progress lines.
    """
    timeout = autoscaler.start_timeout(start_timeout_s, shape)
    if shape is None:
        import ray

        return bool(ray.wait([ready], timeout=timeout)[0])
    return autoscaler.wait_for_nodes(
        ready,
        timeout,
        bundle,
        num_workers,
        shape,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )


def classify_failure(
    exc: BaseException,
    rank: int,
    metadata: Sequence[WorkerMetadata],
    ping_all: Callable[[], list[Any]],
) -> WorkerError:
    """Turn a failed call of worker ``rank`` into a WorkerError, blaming a dead worker if any.

    When a worker process dies, its peers usually fail first with a collective
    error ("connection closed by peer"); that is a symptom. A quick liveness probe
    (``ping_all``: every worker's answer or exception) finds the worker that really
    died, so the failure is reported (and retried) as a lost worker rather than as
    an application error. A peer that does not answer the probe twice (a stopped
    or frozen process) is blamed the same way, as a hung worker.
    """

    from ray.exceptions import RayActorError

    def meta(r: int) -> WorkerMetadata | None:
        return metadata[r] if 0 <= r < len(metadata) else None

    error = describe_failure(exc, rank, meta(rank))
    if isinstance(error, WorkerDiedError):
        return error
    answers = ping_all()
    for other, answer in enumerate(answers):
        if isinstance(answer, RayActorError):
            died = describe_failure(answer, other, meta(other))
            died.args = (f"{died.args[0]}\n(rank {rank} then failed with: {error.args[0][:2000]})",)
            return died
    silent = _silent_ranks(answers, rank)
    if silent:
        # Every actor answers pings from its monitor thread, even inside a stuck
        # collective: only a stopped (SIGSTOP) or frozen process stays silent. Its
        # peers may fail first (TensorFlow's coordination service aborts their
        # collectives after ~10 s): that is a symptom of the silent worker, which a
        # restart cures. A second probe rules out a worker that was merely slow.
        silent &= _silent_ranks(ping_all(), rank)
    if silent:
        other = min(silent)
        where = f" (pid {meta(other).pid} on {meta(other).node_ip})" if meta(other) else ""
        return WorkerHangError(
            f"Worker rank {other}{where} does not answer: its process is stopped or frozen "
            f"(no reply to two liveness probes).\n"
            f"(rank {rank} then failed with: {error.args[0][:2000]})",
            rank=other,
        )
    return error


def _silent_ranks(answers: Sequence[Any], failed_rank: int) -> set[int]:
    """The ranks other than ``failed_rank`` whose liveness probe timed out."""
    from ray.exceptions import GetTimeoutError

    return {
        other
        for other, answer in enumerate(answers)
        if other != failed_rank and isinstance(answer, GetTimeoutError)
    }


def request_workers(bundle: Mapping[str, float], count: int) -> bool:
    """Driver: ask the autoscaler to make room for ``count`` bundles (0 withdraws the ask).

    Ray's ``request_resources`` is a standing demand for capacity, counted with what
    already runs: an elastic group of 2 of 4 workers asks for 4 bundles and the
    autoscaler adds the nodes for the missing 2, which it would never do on its own
    (nothing is pending). Each call replaces the previous ask. Returns False (and asks
    nothing) when no autoscaler is visible.
    """
    import ray

    if not ray.is_initialized():
        return False
    if autoscaler.read_cluster_shape() is None and not autoscaler.autoscaler_runs():
        return False
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[dict(bundle) for _ in range(count)])
    return True
