"""Entry points the TFTrainer runs inside every worker (through the worker group).

Each function is module-level (so it pickles by reference) and keeps what it
builds in the worker's ``WORKER_STATE``. TensorFlow is imported inside the
functions: importing this module (on the driver, or when a worker unpickles a
function) must not start TensorFlow before the backend's rendezvous has set
``TF_CONFIG``.

Whatever is specific to a backend comes from its worker side, a
:class:`~polytrain.backends.core.strategy.KerasStrategy` that the backend makes in
every worker: this module knows no backend by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.strategy import KerasStrategy
from polytrain.compat.keras import check_keras_model
from polytrain.errors import ConfigError, CreatorError, CreatorTypeError
from polytrain.launchers.worker import WORKER_STATE, report_progress
from polytrain.trainer_api.creators import _describe, check_callable

_KEY = "tf_trainer"

_DATA_SIGNATURE = "data_creator(config) -> tf.data.Dataset, or (train_dataset, val_dataset)"
_MODEL_SIGNATURE = (
    "model_creator(config) -> a compiled tf_keras model (built inside the strategy's scope)"
)


@dataclass
class TFCreators:
    """The user's creator functions for a :class:`~polytrain.TFTrainer`.

    Checked on construction (callable with one argument); the ``create_*`` methods
    run on the workers and check what each creator returns.
    """

    model_creator: Callable[[dict], Any]
    data_creator: Callable[[dict], Any]

    def __post_init__(self) -> None:
        check_callable("model_creator", self.model_creator, 1, expected=_MODEL_SIGNATURE)
        check_callable("data_creator", self.data_creator, 1, expected=_DATA_SIGNATURE)

    def create_model(self, config: dict) -> Any:
        """Call ``model_creator`` (inside the strategy's scope) and check it built a compiled tf_keras model."""
        model = self.model_creator(config)
        check_keras_model(model, "model_creator")
        return model

    def create_data(self, config: dict) -> tuple[Any, Any]:
        """Call ``data_creator``; returns ``(train_dataset, val_dataset or None)``."""
        import tensorflow as tf

        value = self.data_creator(config)
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise CreatorError(
                    f"data_creator returned a {type(value).__name__} of {len(value)} items; "
                    f"expected a tf.data.Dataset or a (train_dataset, val_dataset) pair. "
                    f"Signature: {_DATA_SIGNATURE}."
                )
            train, val = value
        else:
            train, val = value, None
        for label, dataset in (("train dataset", train), ("validation dataset", val)):
            if dataset is None and label == "validation dataset":
                continue
            if type(dataset).__module__.startswith("ray.data"):
                # Splitting between the workers must happen once, on the driver.
                raise CreatorTypeError(
                    f"data_creator returned {_describe(dataset)}, a Ray Dataset: a worker "
                    f"cannot split it with the others. Pass it to the trainer instead: "
                    f"TFTrainer(..., datasets={{'train': ds, 'val': val_ds}}) without a "
                    f"data_creator."
                )
            if not isinstance(dataset, tf.data.Dataset):
                raise CreatorTypeError(
                    f"data_creator returned {_describe(dataset)} as its {label}; expected a "
                    f"tf.data.Dataset batched with the global batch size "
                    f"(dataset.batch(config['batch_size'])). Signature: {_DATA_SIGNATURE}."
                )
        return train, val


@dataclass
class TFWorkerSetup:
    """Everything a worker needs to build its model and data (sent once per start)."""

    creators: TFCreators
    backend: Backend
    config: dict[str, Any]
    context: WorkerContext
    max_grad_norm: float | None = None


@dataclass
class TFWorkerState:
    """What one worker built: the backend's strategy, the model and the data sets."""

    strategy: KerasStrategy
    components: Components
    context: WorkerContext
    config: dict[str, Any]

    @property
    def model(self) -> Any:
        """The worker's Keras model (its variables are mirrored across workers)."""
        return self.components.models[0]


def setup_worker(setup: TFWorkerSetup, rank_info: Any) -> int:
    """Make the backend's strategy and its ``tf.distribute`` strategy, then the model in its scope.

    The data sets come next, and the strategy prepares all of them.

    Returns:
        The number of training steps per epoch, or -1 when the data set's length is
        unknown or infinite.
    """
    ctx = setup.context.for_rank(rank_info)
    if not ctx.local_mode:
        _limit_threads(ctx.num_cpus)
    strategy = _keras_strategy(setup.backend)
    distribution = strategy.distribution_strategy(ctx)
    with distribution.scope():
        model = setup.creators.create_model(setup.config)
    if setup.max_grad_norm is not None:
        _set_global_clipnorm(model.optimizer, setup.max_grad_norm)
    train, val = setup.creators.create_data(setup.config)
    components = Components(
        models=[model],
        optimizers=[model.optimizer],
        train_loader=train,
        val_loader=val,
    )
    with strategy.worker_scope(ctx):
        components = strategy.prepare(components, ctx)
    WORKER_STATE[_KEY] = TFWorkerState(strategy, components, ctx, setup.config)
    return _num_batches(components.train_loader)


def _set_global_clipnorm(optimizer: Any, max_norm: float) -> None:
    """Clip by the global norm in the compiled optimizer (tf_keras applies it after aggregation)."""
    if getattr(optimizer, "clipnorm", None) or getattr(optimizer, "clipvalue", None):
        raise ConfigError(
            f"max_grad_norm={max_norm!r} sets the optimizer's global_clipnorm, but the compiled "
            f"{type(optimizer).__name__} already clips (clipnorm={optimizer.clipnorm!r}, "
            f"clipvalue={optimizer.clipvalue!r}). Clip in one place: drop max_grad_norm or the "
            f"optimizer's own clipping."
        )
    optimizer.global_clipnorm = float(max_norm)


def _limit_threads(num_cpus: float) -> None:
    import tensorflow as tf

    # Must precede the strategy, which starts TensorFlow's runtime; one thread pool
    # per reserved CPU keeps co-located workers from oversubscribing the cores.
    threads = max(1, int(num_cpus))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))


def _keras_strategy(backend: Backend) -> KerasStrategy:
    strategy = backend.make_strategy()
    if not isinstance(strategy, KerasStrategy):
        raise ConfigError(
            f"Backend {backend.name!r} has a {type(strategy).__name__} worker side; a "
            f"TFTrainer needs a backend with a KerasStrategy (framework 'tensorflow')."
        )
    return strategy


def _state() -> TFWorkerState:
    try:
        return WORKER_STATE[_KEY]
    except KeyError:
        raise RuntimeError(
            "This worker has no TFTrainer set up (setup_worker was not run)."
        ) from None


def _num_batches(dataset: Any) -> int:
    import tensorflow as tf

    cardinality = int(dataset.cardinality())
    return cardinality if cardinality >= 0 and cardinality != tf.data.INFINITE_CARDINALITY else -1


def _global_batch(dataset: Any, config: dict[str, Any]) -> int | None:
    import tensorflow as tf

    spec = tf.nest.flatten(dataset.element_spec)[0]
    shape = getattr(spec, "shape", None)
    if shape is not None and shape.rank and shape[0] is not None:
        return int(shape[0])
    batch = config.get("batch_size")
    return batch if isinstance(batch, int) and not isinstance(batch, bool) else None


class _Progress:
    """A Keras callback that counts steps and reports them to the driver's monitor."""

    def __new__(cls, total: int | None, epoch: int | None = None) -> Any:
        from polytrain.compat.keras import get_keras

        keras = get_keras()

        class Progress(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                # Keep the logs as tensors: no host sync per batch just to count steps.
                self._supports_tf_logs = True
                self.steps = 0

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.steps += 1
                report_progress(self.steps, total, phase="train", epoch=epoch)

            def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
                self.steps += 1
                report_progress(self.steps, total, phase="validate")

        return Progress()


def _metrics(logs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    # The backend makes Keras report the first replica's (already globally aggregated)
    # metric results, so the loss is the mean over the global batch, not a sum.
    return {
        prefix + key: float(value[-1] if isinstance(value, list) else value)
        for key, value in logs.items()
    }


def train_epoch(epoch: int, num_steps: int | None) -> dict[str, Any]:
    """One epoch (or ``num_steps`` batches) of ``model.fit`` on this worker.

    Returns this worker's view of the epoch: the loss and metrics of the whole
    global batch (identical on every worker), ``num_steps``, ``num_samples``
    (steps times the global batch) and ``epoch_time_s``.
    """
    state = _state()
    dataset = state.components.train_loader
    total = num_steps if num_steps is not None else _num_batches(dataset)
    total = total if total and total > 0 else None
    progress = _Progress(total, epoch)
    report_progress(0, total, phase="train", epoch=epoch)
    start = time.perf_counter()
    history = state.model.fit(
        dataset,
        initial_epoch=epoch,
        epochs=epoch + 1,
        steps_per_epoch=num_steps,
        verbose=0,
        callbacks=[progress],
    )
    elapsed = time.perf_counter() - start
    stats = _metrics(history.history)
    batch = _global_batch(dataset, state.config)
    stats.update(
        epoch=epoch,
        num_steps=progress.steps,
        epoch_time_s=elapsed,
    )
    if batch is not None:
        stats["num_samples"] = progress.steps * batch
    return stats


def validate(num_steps: int | None) -> dict[str, Any]:
    """``model.evaluate`` on the validation data set; metrics get a ``val_`` prefix."""
    state = _state()
    dataset = state.components.val_loader
    if dataset is None:
        raise CreatorError(
            "validate() needs validation data: make data_creator return "
            "(train_dataset, val_dataset)."
        )
    progress = _Progress(num_steps)
    start = time.perf_counter()
    logs = state.model.evaluate(
        dataset, steps=num_steps, verbose=0, return_dict=True, callbacks=[progress]
    )
    stats = _metrics(logs, prefix="val_")
    stats["num_steps"] = progress.steps
    stats["time_s"] = time.perf_counter() - start
    batch = _global_batch(dataset, state.config)
    if batch is not None:
        stats["num_samples"] = progress.steps * batch
    return stats


def get_state() -> dict[str, Any] | None:
    """The model's weights and optimizer variables (rank 0 returns them, others None)."""
    state = _state()
    return state.strategy.full_state_dict(state.components, state.context)


def load_state(payload: dict[str, Any]) -> None:
    """Load weights and optimizer variables on this worker."""
    state = _state()
    state.strategy.load_full_state_dict(state.components, payload, state.context)


def apply_to_model(fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(model)`` on this worker's Keras model."""
    return fn(_state().model)


def teardown_worker() -> None:
    """Drop this worker's trainer state."""
    WORKER_STATE.pop(_KEY, None)
