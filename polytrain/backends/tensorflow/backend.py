"""The mwms backend: :class:`MWMSConfig`, the ``TF_CONFIG`` rendezvous and the Keras strategy."""

from __future__ import annotations

from polytrain.backends.core.backend import Backend
from polytrain.backends.tensorflow.config import MWMSConfig
from polytrain.backends.tensorflow.rendezvous import (
    TFConfigRendezvous,
)
from polytrain.backends.tensorflow.strategy import (
    MWMSStrategy,
)
from polytrain.errors import ConfigError


class MultiWorkerMirroredBackend(Backend):
    """Synchronous data parallelism with ``tf.distribute.MultiWorkerMirroredStrategy``.

    Every worker holds a full replica of the Keras model; gradients are all-reduced
    after every step (ring all-reduce over gRPC on CPU, NCCL on GPU). Models must be
    ``tf_keras`` (Keras 2) models: see :mod:`polytrain.compat.keras`.
    """

    name = "mwms"
    framework = "tensorflow"
    preload_modules = ()  # TensorFlow is imported by the first task, once TF_CONFIG is set
    config_cls = MWMSConfig
    rendezvous_cls = TFConfigRendezvous
    strategy_cls = MWMSStrategy
    config: MWMSConfig
    accelerate_refusal = "Accelerate and the HF Trainer train torch models, not Keras ones."

    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: NCCL needs GPUs; mixed precision is a Keras policy set in the creator.

        Raises:
            ConfigError: ``communication="nccl"`` on CPU, or ``use_fp16``.
        """
        if self.config.communication == "nccl" and not use_gpu:
            raise ConfigError(
                "communication='nccl' needs use_gpu=True; use 'ring' or 'auto' on CPU."
            )
        if use_fp16:
            raise ConfigError(
                "use_fp16 is not a TFTrainer option: set a Keras mixed-precision policy in "
                "model_creator (keras.mixed_precision.set_global_policy('mixed_float16'))."
            )
