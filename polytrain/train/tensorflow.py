"""``polytrain.train.tensorflow.TensorflowTrainer``: your own TensorFlow loop on ``mwms`` workers.

As in Ray Train, every worker starts with its ``TF_CONFIG`` set (by the ``mwms``
backend's rendezvous, with ``TF_USE_LEGACY_KERAS=1``), so the loop creates
``tf.distribute.MultiWorkerMirroredStrategy()`` itself and trains with ``fit`` or
a custom ``GradientTape`` loop; ``report`` / ``get_checkpoint`` / ``get_context``
work as for torch. Create the strategy before any other TensorFlow operation.
"""

from __future__ import annotations

from polytrain.train.trainer import DataParallelTrainer, _TFLoopRunner

__all__ = ["TensorflowTrainer"]


class TensorflowTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on TensorFlow workers (``backend="mwms"``)."""

    _default_backend = "mwms"
    _runner_cls = _TFLoopRunner
