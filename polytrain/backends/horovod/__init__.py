"""Horovod ring-allreduce on the worker group's actors, rendezvous through Horovod's gloo controller.

The backend binds three parts:

- :class:`HorovodConfig`: the options (compression, accumulation, reduce op, stall checks);
- :class:`~polytrain.backends.horovod.rendezvous.HorovodRendezvous` (driver side):
  Horovod's HTTP rendezvous server on the driver, the ``horovodrun --gloo``
  environment in every worker and ``hvd.init()`` there, with Horovod's ranks equal
  to the worker group's world ranks;
- :class:`~polytrain.backends.horovod.strategy.HorovodStrategy` (worker side): the
  user's optimizers wrapped in ``hvd.DistributedOptimizer``, rank 0's state
  broadcast, accumulation and ``no_sync``.

``horovod`` is imported inside the functions that need it, so importing this
module (done lazily by the registry) loads no Horovod code in the driver until
a trainer starts.

The folder: ``config.py`` (the options; imports only the backend contracts and errors),
``backend.py`` (:class:`HorovodBackend`, binding the parts), and the driver and worker
sides next to them. Importing this package imports no optional framework.
"""

from polytrain.backends.horovod.config import HorovodConfig

__all__ = ["HorovodConfig"]
