"""The worker side of the ``mwms`` backend: ``MultiWorkerMirroredStrategy`` and Keras state.

:class:`MWMSStrategy` runs in every worker: it builds the ``tf.distribute``
strategy (after the rendezvous set ``TF_CONFIG``), checks the Keras model, sets
the data sets' auto-sharding policy and moves the model's and optimizer's
variables to and from numpy. TensorFlow is imported inside the methods only.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.strategy import KerasStrategy
from polytrain.compat.keras import check_keras_model, optimizer_weights, set_optimizer_weights
from polytrain.errors import CheckpointError

if TYPE_CHECKING:
    from polytrain.backends.core.context import Components, WorkerContext
    from polytrain.backends.tensorflow.config import MWMSConfig


class MWMSStrategy(KerasStrategy):
    """Worker side of ``mwms``: one Keras model replicated on every worker.

    The ``tf.distribute`` strategy distributes the model (its variables are created
    in ``strategy.scope()``) and the data sets (``model.fit`` splits them); this
    object creates that strategy, rejects models that cannot train under it and
    tells tf.data how to split the global batches between workers.
    """

    config: MWMSConfig

    def distribution_strategy(self, ctx: WorkerContext) -> Any:
        """Worker: ``tf.distribute.MultiWorkerMirroredStrategy`` (the default one in local mode).

        Creating it starts this worker's gRPC server and connects to the others, so
        it must run before any other TensorFlow operation in the process.
        """
        import tensorflow as tf

        if ctx.local_mode:
            return tf.distribute.get_strategy()
        implementation = self.config.communication
        if implementation == "auto" and ctx.use_gpu:
            implementation = "nccl"
        timeout = self.config.collective_timeout_s
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=getattr(
                tf.distribute.experimental.CommunicationImplementation, implementation.upper()
            ),
            # Not ctx.timeout_s: see MWMSConfig.collective_timeout_s (a thread per op).
            timeout_seconds=float(timeout) if timeout else None,
        )
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    def shard_options(self) -> Any:
        """Worker: ``tf.data.Options`` with the configured auto-shard policy."""
        import tensorflow as tf

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, self.config.auto_shard_policy.upper()
        )
        return options

    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: check the model is a compiled tf_keras model; set the data sharding policy.

        Raises:
            CreatorError: the model is not a compiled tf_keras model.
        """
        model = components.models[0]
        check_keras_model(model, "model_creator")
        if getattr(model, "_distribute_reduction_method", None) is None:
            # Every replica's metric results are already aggregated over all workers, so
            # report the first replica's. Keras's default ("auto") SUMs the replicas'
            # values across workers, which logs a multiple of the loss wherever those
            # values are not collapsed into one first.
            model.distribute_reduction_method = "first"
        options = self.shard_options()
        components.train_loader = components.train_loader.with_options(options)
        if components.val_loader is not None:
            components.val_loader = components.val_loader.with_options(options)
        return components

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker: the model's weights and the optimizer's variables as numpy arrays.

        Mirrored variables hold the same value on every worker, so rank 0 reads its own.
        """
        if ctx.world_rank != 0:
            return None
        model = components.models[0]
        return {
            "models": [[w.copy() for w in model.get_weights()]],
            "optimizers": [optimizer_weights(model.optimizer)],
        }

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker: load weights (and optimizer variables, when present) on every rank.

        Raises:
            CheckpointError: the state holds another number of models, or optimizer
                variables that do not fit the model's optimizer.
        """
        model = components.models[0]
        weights = state["models"]
        if len(weights) != 1:
            raise CheckpointError(
                f"The checkpoint holds {len(weights)} models; a TFTrainer trains exactly one."
            )
        model.set_weights(weights[0])
        optimizers = state.get("optimizers") or [None]
        # The optimizer's slots are variables: build them in the scope of the strategy the
        # model was created under (Keras remembers it).
        strategy = getattr(model, "distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            set_optimizer_weights(model.optimizer, model, optimizers[0])
