"""TensorFlow ``MultiWorkerMirroredStrategy`` on Ray actors, configured through ``TF_CONFIG``.

The backend binds two sides:

- :class:`~polytrain.backends.tensorflow_rendezvous.TFConfigRendezvous` (driver):
  asks every worker for its address and a free port, builds each worker's
  ``TF_CONFIG`` and sets it in the workers before they import TensorFlow;
- :class:`~polytrain.backends.tensorflow_strategy.MWMSStrategy` (worker): creates
  the ``tf.distribute`` strategy, checks the Keras model, sets the data sets'
  auto-sharding policy and moves the Keras state to and from numpy.

TensorFlow is imported only inside the worker side's methods, never when this
module is imported: the driver can resolve and configure the backend without
paying for (or initialising) TensorFlow. The names of the two sides' modules are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.tensorflow_rendezvous import (
    TFConfigRendezvous,
    build_tf_config,
    cluster_addresses,
    format_address,
    is_chief,
    plan_ports,
    worker_env,
)
from polytrain.backends.tensorflow_strategy import (
    MWMSStrategy,
    optimizer_weights,
    set_optimizer_weights,
)
from polytrain.compat.keras import check_keras_model
from polytrain.errors import ConfigError

__all__ = [
    "AUTO_SHARD_POLICIES",
    "COMMUNICATIONS",
    "MWMSConfig",
    "MWMSStrategy",
    "MultiWorkerMirroredBackend",
    "TFConfigRendezvous",
    "build_tf_config",
    "check_keras_model",
    "cluster_addresses",
    "format_address",
    "is_chief",
    "optimizer_weights",
    "plan_ports",
    "set_optimizer_weights",
    "worker_env",
]

COMMUNICATIONS = ("auto", "ring", "nccl")
AUTO_SHARD_POLICIES = ("data", "file", "auto", "off")


@dataclass
class MWMSConfig(BackendConfig):
    """Options of the ``mwms`` backend.

    Attributes:
        communication: the collective implementation: "auto" (TensorFlow's choice on
            CPU, NCCL on GPU), "ring" (gRPC ring all-reduce, works everywhere) or
            "nccl" (GPU only).
        auto_shard_policy: how every worker gets its share of the input data sets:
            "data" (default: every worker reads the whole pipeline and keeps its part
            of each global batch; works for any data set), "file" (workers read
            different input files; needs at least as many files as workers), "auto"
            (file if possible, else data) or "off" (no sharding: the data set must
            already differ per worker).
        collective_timeout_s: timeout of one collective operation, or None (the
            default) for none. TensorFlow implements it with one extra thread per
            collective op that sleeps for the whole timeout, even after the op is done:
            about 8 threads per training step of a 3-layer MLP, so a 1800 s timeout at
            50 steps/s would hold some 700,000 threads. Without it, a lost worker is still
            caught by Ray (the group is torn down at once) and a hung one by
            ``failure_config.hang_timeout_s``; set a short value (tens of seconds) only
            if you need TensorFlow itself to abort a stuck collective.

    ``failure_config.collective_timeout_s`` (the torch and Horovod collective timeout)
    does not apply to this backend, for the reason above.
    """

    communication: str = "auto"
    auto_shard_policy: str = "data"
    collective_timeout_s: float | None = None

    def __post_init__(self) -> None:
        timeout = self.collective_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(
                f"collective_timeout_s must be a positive number of seconds or None (no "
                f"timeout); got {timeout!r}."
            )
        for name, allowed in (
            ("communication", COMMUNICATIONS),
            ("auto_shard_policy", AUTO_SHARD_POLICIES),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value.lower() not in allowed:
                raise ConfigError(
                    f"The provided {name} ({value!r}) is not supported. Must be one of "
                    f"{', '.join(repr(a) for a in allowed)}."
                )
            setattr(self, name, value.lower())


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
