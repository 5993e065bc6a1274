"""TFTrainer: train a Keras model with TensorFlow's MultiWorkerMirroredStrategy on Ray actors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.step_options import StepOptions
from polytrain.errors import ConfigError, CreatorError
from polytrain.launchers.base import WorkerGroup
from polytrain.trainer_api.data import ray_data
from polytrain.trainer_api.options.configs import (
    CheckpointConfig,
    FailureConfig,
    ScalingConfig,
)
from polytrain.trainer_api.tensorflow import checkpoint as checkpoint_tf
from polytrain.trainer_api.tensorflow import ray_data as ray_data_tf
from polytrain.trainer_api.tensorflow import worker as tf_worker
from polytrain.trainer_api.trainer import BaseTrainer

_WEIGHT_KEYS = ("models", "optimizers")


class TFTrainer(BaseTrainer):
    """Train a compiled Keras (tf_keras) model on Ray workers with ``MultiWorkerMirroredStrategy``.

    Every worker holds a replica of the model; ``model.fit`` runs on all of them at
    once and the strategy all-reduces the gradients after every step. Workers find
    each other through the ``TF_CONFIG`` the backend gives each of them; worker 0 is
    the chief.

    Example:
        >>> import tf_keras as keras
        >>> def model_creator(config):
        ...     model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        ...     model.compile(optimizer=keras.optimizers.SGD(config["lr"]),
        ...                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ...                   metrics=["accuracy"])
        ...     return model
        >>> def data_creator(config):
        ...     train = tf.data.Dataset.from_tensor_slices((x, y)).batch(config["batch_size"])
        ...     return train, val
        >>> trainer = TFTrainer(model_creator=model_creator, data_creator=data_creator,
        ...                     config={"lr": 0.1, "batch_size": 64}, num_workers=2)
        >>> stats = trainer.train(); trainer.validate()["val_accuracy"]
        >>> trainer.save("ckpt.pt"); model = trainer.get_model(); trainer.shutdown()

    The batch rule: ``config["batch_size"]`` is the **global** batch, and
    ``data_creator`` receives it unchanged. Batch the data sets with it
    (``dataset.batch(config["batch_size"])``); the strategy splits every global
    batch between the workers (with the default ``auto_shard_policy="data"``,
    worker ``i`` trains on the ``i``-th slice of each global batch). So 2 workers
    with ``batch_size=64`` take the same optimisation steps as 1 worker with 64.
    (``TorchTrainer`` differs: it divides ``batch_size`` by ``num_workers`` before
    its ``data_creator`` sees it, because each torch worker builds its own loader.)

    Keras: models must be tf_keras (Keras 2) models. The workers start with
    ``TF_USE_LEGACY_KERAS=1``, so ``tf.keras`` there is tf_keras; ``import tf_keras
    as keras`` works everywhere. A Keras 3 model is rejected with an error that
    says how to fix it.

    Checkpoints (:meth:`state_dict`, :meth:`save`): ``"models"`` is ``[weights]``
    where ``weights`` is ``model.get_weights()`` (a list of numpy arrays);
    ``"optimizers"`` is ``[variables]``, the optimizer's variables (iteration count
    and slots) as numpy arrays, or ``[None]`` before the first step. :meth:`save`
    stores the arrays as torch tensors in a ``torch.save`` file, so :meth:`load`
    reads it with ``weights_only=True`` (no arbitrary unpickling).

    Args:
        model_creator: ``config -> keras.Model``, compiled (``model.compile(...)``).
            Called inside ``strategy.scope()`` on every worker.
        data_creator: ``config -> tf.data.Dataset`` or ``(train_dataset, val_dataset)``,
            batched with the global batch ``config["batch_size"]``. Called on every
            worker; every worker must produce the same data in the same order (fixed
            seeds) for the default "data" sharding. Leave it out when ``datasets`` is given.
        config: the user's hyperparameters, passed to both creators.
        num_workers: shortcut for ``scaling_config.num_workers`` (0 = local mode: one
            worker in the driver process, no Ray, TensorFlow's default strategy).
        use_gpu: shortcut for ``scaling_config.use_gpu``; every worker gets one GPU.
        num_cpus_per_worker: shortcut for ``scaling_config.num_cpus_per_worker``; also
            the worker's TensorFlow intra-op threads.
        backend: "mwms" (aliases "tensorflow", "tf", "multi_worker_mirrored") or a
            TensorFlow :class:`~polytrain.backends.Backend` instance.
        backend_config: :class:`~polytrain.backends.tensorflow.config.MWMSConfig` or a dict:
            ``communication`` ("auto" | "ring" | "nccl") and ``auto_shard_policy``
            ("data" | "file" | "auto" | "off").
        use_tqdm: show the chief's progress as a bar on the driver.
        scaling_config: :class:`ScalingConfig` (or dict): workers, resources, placement.
        failure_config: :class:`FailureConfig` (or dict); ``collective_timeout_s`` is
            the timeout of one collective operation.
        checkpoint_config: :class:`CheckpointConfig` (or dict).
        init_hook: a function of no arguments run on every worker after it starts (and
            after a restart), before ``TF_CONFIG`` is set and TensorFlow starts.
        loggers: experiment trackers (Logger instances or "tensorboard", "mlflow",
            "wandb", "csv") that get the metrics of every call.
        datasets: Ray Data input instead of ``data_creator``: ``{"train": ds, "val": ds}``
            (``ray.data.Dataset``), split between the workers with ``streaming_split``
            and read on each as ``tf.data`` in batches of the global batch, which the
            strategy splits between the workers; the backend's ``auto_shard_policy``
            becomes "off" (see :mod:`polytrain.trainer_api.tensorflow.ray_data`).
        dataset_columns: with ``datasets``: ``{"features": name or [names], "label":
            name or [names]}``; default: the last column is the label, the others the
            features (one name: a tensor; a list: a dict keyed by column name).
        max_grad_norm: clip the global gradient norm to this before every optimizer
            step (the Keras optimizer's ``global_clipnorm``, which under
            MultiWorkerMirroredStrategy clips after the gradients are summed over the
            workers); None: as the compiled optimizer says.
    """

    framework = "tensorflow"
    checkpoint_worker_module = checkpoint_tf

    def __init__(
        self,
        *,
        model_creator: Callable[[dict], Any],
        data_creator: Callable[[dict], Any] | None = None,
        config: dict[str, Any] | None = None,
        num_workers: int | None = None,
        use_gpu: bool | None = None,
        num_cpus_per_worker: float | None = None,
        backend: str | Backend = "mwms",
        backend_config: Any = None,
        use_tqdm: bool = False,
        scaling_config: ScalingConfig | dict | None = None,
        failure_config: FailureConfig | dict | None = None,
        checkpoint_config: CheckpointConfig | dict | None = None,
        init_hook: Callable[[], None] | None = None,
        loggers: Any = None,
        datasets: dict[str, Any] | None = None,
        dataset_columns: dict[str, Any] | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        self.max_grad_norm = StepOptions(max_grad_norm=max_grad_norm).max_grad_norm
        self.datasets = ray_data.check_datasets(datasets, data_creator, "tf.data datasets")
        if self.datasets is not None:
            self.dataset_columns = ray_data_tf.check_columns(self.datasets, dataset_columns)
            data_creator = ray_data_tf.shard_datasets
        elif dataset_columns is not None:
            raise ConfigError(
                f"dataset_columns={dataset_columns!r} applies only to datasets= (Ray Data); "
                f"pass datasets, or drop dataset_columns."
            )
        self.creators = tf_worker.TFCreators(model_creator, data_creator)
        super().__init__(
            backend=backend,
            backend_config=backend_config,
            config=config,
            num_workers=num_workers,
            use_gpu=use_gpu,
            num_cpus_per_worker=num_cpus_per_worker,
            scaling_config=scaling_config,
            failure_config=failure_config,
            checkpoint_config=checkpoint_config,
            use_fp16=False,
            use_tqdm=use_tqdm,
            init_hook=init_hook,
            loggers=loggers,
        )
        if self.datasets is not None:
            ray_data_tf.turn_off_auto_shard(self.backend)
        self._start()

    # ------------------------------------------------------------- workers
    def setup_workers(self, group: WorkerGroup) -> None:
        """Run loop: build the creators' Keras model and data on every worker of a new group."""
        if self.datasets is not None:  # a fresh split for every group: no stale coordinator
            shards = ray_data.split(self.datasets, len(group))
            group.get(
                [
                    group.execute_single_async(
                        rank, ray_data_tf.receive_shards, shard, self.dataset_columns
                    )
                    for rank, shard in enumerate(shards)
                ]
            )
        setup = tf_worker.TFWorkerSetup(
            creators=self.creators,
            backend=self.backend,
            config=self.config,
            context=self._context_template(),
            max_grad_norm=self.max_grad_norm,
        )
        refs = [
            group.execute_single_async(rank, tf_worker.setup_worker, setup, info)
            for rank, info in enumerate(group.rank_infos)
        ]
        group.get(refs)

    def _worker_state(self) -> dict[str, Any]:
        return self._run(tf_worker.get_state)[0]

    def _load_worker_state(self, state: dict[str, Any]) -> None:
        payload = {key: _to_numpy(state.get(key)) for key in _WEIGHT_KEYS}
        self._run(tf_worker.load_state, self._share(payload))

    def _file_state(self, state: dict[str, Any]) -> dict[str, Any]:
        # torch tensors: the file is then readable with torch.load(weights_only=True).
        return {**state, **{key: _to_tensors(state.get(key)) for key in _WEIGHT_KEYS}}

    # ------------------------------------------------------------ training
    def train(
        self,
        num_steps: int | None = None,
        *,
        max_retries: int | None = None,
        end_epoch: bool = True,
    ) -> dict[str, Any]:
        """Train one epoch (or ``num_steps`` global batches) with ``model.fit`` on every worker.

        Epochs count up across calls (``fit(initial_epoch=e, epochs=e + 1)``), so
        epoch-based callbacks and schedules in the model see the right epoch. Unlike
        :meth:`TorchTrainer.train <polytrain.TorchTrainer.train>`, every call is an
        epoch of its own: ``fit`` starts the data set's iterator afresh, so
        ``num_steps`` takes the first batches of the data set each time.

        Args:
            num_steps: at most this many global batches; None: the whole data set.
            max_retries: restarts allowed for this call after a lost or hung worker,
                instead of ``failure_config.max_retries``.
            end_epoch: every call ends its epoch here; only True is accepted (it exists
                so that code written for both trainers can pass it).

        Returns:
            The chief's view of the epoch: ``epoch``, ``loss`` (the mean over the
            global batch), the compiled metrics (e.g. ``accuracy``), ``num_steps``,
            ``num_samples`` (steps times the global batch), ``epoch_time_s`` (the
            slowest worker), ``samples_per_s``, ``num_restarts``, ``num_workers``
            and ``checkpoint_path`` (with a ``checkpoint_dir``).
        """
        if not end_epoch:
            raise ConfigError(
                "TFTrainer.train(end_epoch=False) is not supported: model.fit starts the data "
                "set afresh at every call, so every call is an epoch. Drop end_epoch=False."
            )
        with self.termination.watching():  # SIGTERM: a checkpoint at the epoch end, then stop
            self._begin_call(max_retries)
            results = self._run(
                tf_worker.train_epoch,
                progress=f"epoch {self.epoch}",
                max_retries=max_retries,
                args_fn=lambda: (self.epoch, num_steps),
            )
            stats = _chief_stats(results, "epoch_time_s")
            self._end_call(stats, {"epoch": self.epoch, "position": 0, "epoch_done": True})
            # The epoch-end state a restart resumes from: a directory the workers write, or a
            # dict through the driver when they cannot see the checkpoint directory.
            local_only = self.scaling.local_mode and self.checkpoint.checkpoint_dir is None
            if self._keeps_state and not local_only and self.checkpoints.workers_see_directory():
                written = self._run(
                    checkpoint_tf.save_dir, args_fn=lambda: (self.checkpoints.request(self.epoch),)
                )
                self.checkpoints.keep_directory(stats, written)
            else:
                state = self._worker_state() if self._keeps_state else None
                self.checkpoints.keep_state(stats, state, None)
            self._log("train", stats)
            self._stop_if_terminated()
        return stats

    def validate(self, num_steps: int | None = None) -> dict[str, Any]:
        """``model.evaluate`` on the validation data set (all of it, or ``num_steps`` batches).

        Returns:
            ``val_loss``, the compiled metrics with a ``val_`` prefix (e.g.
            ``val_accuracy``), ``num_steps``, ``num_samples`` and ``time_s``.
        """
        results = self._run(tf_worker.validate, num_steps)
        stats = _chief_stats(results, "time_s")
        self._log("val", stats)
        return stats

    def apply_all_models(self, fn: Callable[[Any], Any]) -> list[Any]:
        """Run ``fn(model)`` on every worker's Keras model; returns the results in rank order."""
        return self._run(tf_worker.apply_to_model, fn)

    def get_model(self) -> Any:
        """The trained model, built by ``model_creator`` in the driver (no strategy).

        The driver imports TensorFlow here. ``TF_USE_LEGACY_KERAS=1`` is set while
        ``model_creator`` runs, so a creator using ``tf.keras`` builds a tf_keras
        model, unless this process resolved ``tf.keras`` to Keras 3 earlier; set the
        variable at the top of the driver script (or use ``import tf_keras``) to be sure.
        """
        from polytrain.compat.keras import legacy_keras_env

        state = self.state_dict()
        with legacy_keras_env():
            model = self.creators.create_model(self.config)
        if not model.built:
            raise CreatorError(
                f"model_creator built an unbuilt {type(model).__name__} in the driver, so the "
                f"trained weights cannot be set on it. Give the model its input shape (e.g. "
                f"keras.Input(shape=...) as its first layer) so it is built on creation."
            )
        model.set_weights(state["models"][0])
        return model

    def shutdown(self, force: bool = False, release_workers: bool = False) -> None:
        """Stop every worker and release their resources. Later calls raise.

        ``force=True`` kills the workers at once; ``release_workers=True`` gives every
        idle warm worker back too (see :meth:`BaseTrainer.shutdown`).
        """
        if self._group is not None and self.scaling.local_mode:
            # The local "worker" is this process: drop the model it holds.
            self._group.execute(tf_worker.teardown_worker)
        super().shutdown(force=force, release_workers=release_workers)


def _chief_stats(results: list[dict[str, Any]], time_key: str) -> dict[str, Any]:
    # Every worker reports the loss and metrics of the whole global batch, so the chief's
    # numbers are the answer; only the time is the slowest worker's.
    stats = dict(results[0])
    stats[time_key] = max(r[time_key] for r in results)
    if stats.get("num_samples") and stats[time_key] > 0:
        stats["samples_per_s"] = stats["num_samples"] / stats[time_key]
    return stats


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_to_numpy(v) for v in value]
    if hasattr(value, "detach"):  # a torch tensor read from a checkpoint file
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _to_tensors(value: Any) -> Any:
    import torch

    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_to_tensors(v) for v in value]
    return torch.from_numpy(np.array(value, copy=True, order="C"))
