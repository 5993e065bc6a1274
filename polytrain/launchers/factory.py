"""The one way to build a worker group from a :class:`ScalingConfig`.

Used by the trainers and the Lightning strategies alike, so both place workers
the same way. Ray is imported only for a Ray group: local mode never touches it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.cluster.autoscaler import START_TIMEOUT_S
from polytrain.launchers.local import LocalWorkerGroup
from polytrain.launchers.scaling import ScalingConfig


def make_group(
    scaling: ScalingConfig,
    env_vars: dict[str, str] | None = None,
    num_workers: int | None = None,
    preload: Sequence[str] = (),
    process_env: dict[str, str] | None = None,
) -> WorkerGroup:
    """A worker group for ``scaling``, not started yet (the caller calls ``group.start()``).

    Local mode (``num_workers=0``) gives a :class:`LocalWorkerGroup` in this
    process. Otherwise this connects to Ray (``scaling.address``; see
    :func:`~polytrain.launchers.cluster.connect.ensure_ray`) and gives a
    :class:`~polytrain.launchers.worker_group.RayWorkerGroup`.

    Args:
        scaling: workers, resources per worker, placement, cluster address.
        env_vars: environment every worker starts with.
        num_workers: the group size when it differs from ``scaling.num_workers``
            (a shrunk elastic group).
        preload: modules new workers import in the background as soon as they start
            (the backend's ``preload_modules``); see
            :class:`~polytrain.launchers.worker_group.RayWorkerGroup`.
        process_env: environment the worker processes are started with (the
            backend's ``worker_process_env``); see
            :class:`~polytrain.launchers.worker_group.RayWorkerGroup`. Local mode
            has no process to start: the driver's own keeps its environment.

    Raises:
        ConnectionError: the Ray cluster at ``scaling.address`` cannot be reached.
    """
    if scaling.local_mode:
        return LocalWorkerGroup(env_vars=env_vars)
    from polytrain.launchers.cluster.connect import ensure_ray
    from polytrain.launchers.worker_group import RayWorkerGroup

    connect_timeout = (
        START_TIMEOUT_S if scaling.start_timeout_s is None else scaling.start_timeout_s
    )
    ensure_ray(scaling.address, timeout_s=connect_timeout)
    from polytrain.compat import quiet

    # The workers are as quiet (or verbose) as the driver from their first import on.
    env_vars = {**quiet.worker_env(), **(env_vars or {})}
    return RayWorkerGroup(
        num_workers=scaling.num_workers if num_workers is None else num_workers,
        num_cpus_per_worker=scaling.num_cpus_per_worker,
        num_gpus_per_worker=scaling.gpus_per_worker,
        resources_per_worker=scaling.resources_per_worker,
        placement_strategy=scaling.placement_strategy,
        start_timeout_s=scaling.start_timeout_s,
        env_vars=env_vars,
        preload=preload,
        process_env=process_env,
    )


def placeable_workers(scaling: ScalingConfig, excluded_nodes: Iterable[str] = ()) -> int:
    """How many more workers shaped like ``scaling``'s the cluster's free resources hold now.

    Nodes in ``excluded_nodes`` (draining ones) are not counted. Local mode holds
    none: it has no cluster.
    """
    if scaling.local_mode:
        return 0
    from polytrain.launchers.cluster.connect import placeable_bundles

    return placeable_bundles(scaling.worker_bundle(), excluded_nodes)
