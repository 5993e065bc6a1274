"""``polytrain.train.horovod.HorovodTrainer``: Ray Train 1.x's Horovod trainer, on Horovod's gloo ring.

The backend's rendezvous runs ``hvd.init()`` on every worker before the loop
starts; the loop's own ``hvd.init()`` finds Horovod initialised and returns.
Wrap the optimizer yourself (``hvd.DistributedOptimizer`` and broadcasts, as in
Horovod's examples) or with :func:`polytrain.train.torch.prepare`.
"""

from __future__ import annotations

from polytrain.train.trainer import DataParallelTrainer

__all__ = ["HorovodTrainer"]


class HorovodTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on Horovod workers (``backend="horovod"``)."""

    _default_backend = "horovod"
