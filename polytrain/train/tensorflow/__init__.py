"""``polytrain.train.tensorflow.TensorflowTrainer``: your own TensorFlow loop on ``mwms`` workers.

As in Ray Train, every worker starts with its ``TF_CONFIG`` set (by the ``mwms``
backend's rendezvous, with ``TF_USE_LEGACY_KERAS=1``), so the loop creates
``tf.distribute.MultiWorkerMirroredStrategy()`` itself and trains with ``fit`` or
a custom ``GradientTape`` loop; ``report`` / ``get_checkpoint`` / ``get_context``
work as for torch. Create the strategy before any other TensorFlow operation.
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import ConfigError
from polytrain.train.backend import BackendConfig
from polytrain.train.tensorflow.checkpoint import TensorflowCheckpoint
from polytrain.train.trainer import DataParallelTrainer, _TFLoopRunner

__all__ = [
    "TensorflowCheckpoint",
    "TensorflowConfig",
    "TensorflowTrainer",
    "prepare_dataset_shard",
]


class TensorflowConfig(BackendConfig):
    """Ray Train's ``TensorflowConfig`` (no options): the ``mwms`` backend sets ``TF_CONFIG``."""

    def to_polytrain(self) -> None:
        """No backend option is set."""
        return None


def prepare_dataset_shard(tf_dataset_shard: Any) -> Any:
    """A ``tf.data.Dataset`` of this worker's shard with auto-sharding off and prefetching on.

    For a dataset made from ``get_dataset_shard(...).to_tf(...)``: the shard is this
    worker's already, so ``tf.distribute`` must not shard it again (Ray Train's helper).
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf_dataset_shard.with_options(options).prefetch(tf.data.AUTOTUNE)


class TensorflowTrainer(DataParallelTrainer):
    """Run ``train_loop_per_worker`` on TensorFlow workers (``backend="mwms"``).

    Ray's ``tensorflow_config`` (a :class:`TensorflowConfig`) is taken too.
    """

    _default_backend = "mwms"
    _runner_cls = _TFLoopRunner

    def __init__(
        self, *args: Any, tensorflow_config: TensorflowConfig | None = None, **kwargs: Any
    ) -> None:
        if tensorflow_config is not None and not isinstance(tensorflow_config, TensorflowConfig):
            raise ConfigError(
                f"tensorflow_config must be a polytrain.train.tensorflow.TensorflowConfig; got "
                f"{type(tensorflow_config).__name__}: {tensorflow_config!r}."
            )
        super().__init__(*args, **kwargs)
