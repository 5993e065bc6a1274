"""``polytrain.train.collective``: Ray Train's ``barrier`` and ``broadcast_from_rank_zero``.

They work on every backend, TensorFlow and Horovod included, without a process
group: the ranks meet at the run's report board on the driver.
"""

from polytrain.train.collective.collectives import barrier, broadcast_from_rank_zero

__all__ = ["barrier", "broadcast_from_rank_zero"]
