"""How worker processes start and run functions. Knows nothing of trainers or backends.

- :mod:`~polytrain.launchers.base`: the :class:`WorkerGroup` contract;
- :mod:`~polytrain.launchers.worker_group`: :class:`RayWorkerGroup` (Ray actors);
- :mod:`~polytrain.launchers.local`: :class:`LocalWorkerGroup` (the driver process);
- :mod:`~polytrain.launchers.factory`: :func:`make_group`, the one way to build a group;
- :mod:`~polytrain.launchers.scaling`: :class:`ScalingConfig`;
- :mod:`~polytrain.launchers.cluster.connect`: connecting to Ray;
- :mod:`~polytrain.launchers.ranks`, :mod:`~polytrain.launchers.worker`,
  :mod:`~polytrain.launchers.cluster.jobs`: ranks, the worker process, Ray Jobs.

Importing this package does not import Ray.
"""

from polytrain.launchers.base import WorkerGroup
from polytrain.launchers.factory import make_group
from polytrain.launchers.local import LocalWorkerGroup
from polytrain.launchers.scaling import ScalingConfig

__all__ = ["LocalWorkerGroup", "ScalingConfig", "WorkerGroup", "make_group"]
