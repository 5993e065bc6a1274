"""TFTrainer with MultiWorkerMirroredStrategy on real Ray actors (and in local mode).

TensorFlow starts slowly, so the tests share two trainers: two Ray workers, and a
one-worker trainer in local mode (``num_workers=0``, in this process). The tests
that need every CPU free run first (creator errors) and last (worker failure).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from examples import tf_digits
from polytrain import TFTrainer
from polytrain.errors import ConfigError, CreatorError, TrainerShutdownError, WorkerError

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

# No shuffling: 2 workers must see the same global batches, in the same order, as 1.
CONFIG = {"lr": 0.05, "batch_size": 64, "shuffle": False}
CREATORS = {"model_creator": tf_digits.model_creator, "data_creator": tf_digits.data_creator}


@pytest.fixture(scope="module", autouse=True)
def tensorflow_imported():
    """Import TensorFlow before the per-test environment guard takes its snapshot.

    Importing TensorFlow and Keras sets process-wide variables once (TF2_BEHAVIOR,
    TPU_ML_PLATFORM, HDF5_PLUGIN_PATH, ...); the local-mode trainer and get_model()
    import them in this process.
    """
    import keras  # noqa: F401
    import tensorflow  # noqa: F401
    import tf_keras  # noqa: F401


def _torch_imported() -> bool:
    import sys

    return "torch" in sys.modules


def _thread_count() -> int:
    import psutil

    return psutil.Process().num_threads()


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [w.shape for w in a] == [w.shape for w in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _get_weights(model):
    return model.get_weights()


# --------------------------------------------------------- creator errors


def keras3_model_creator(config):
    import keras  # Keras 3, whatever TF_USE_LEGACY_KERAS says

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_creator_errors_name_the_creator_and_the_fix():
    # Local mode: the same worker code in this process, errors propagate unchanged.
    with pytest.raises(CreatorError, match=r"model_creator returned a Keras 3 model") as info:
        TFTrainer(
            **{**CREATORS, "model_creator": keras3_model_creator}, config=CONFIG, num_workers=0
        )
    assert "import tf_keras as keras" in str(info.value)
    assert "TF_USE_LEGACY_KERAS=1" in str(info.value)

    def numpy_data_creator(config):
        (x, y), _ = tf_digits.load_digits_arrays()
        return x, y

    with pytest.raises(
        CreatorError,
        match=r"(?s)data_creator returned ndarray .* as its train dataset; expected a tf.data.Dataset",
    ):
        TFTrainer(**{**CREATORS, "data_creator": numpy_data_creator}, config=CONFIG, num_workers=0)

    def uncompiled_creator(config):
        import tf_keras as keras

        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])

    with pytest.raises(CreatorError, match=r"uncompiled model .*call model.compile"):
        TFTrainer(**{**CREATORS, "model_creator": uncompiled_creator}, config=CONFIG, num_workers=0)

    with pytest.raises(CreatorError, match=r"data_creator .* cannot be called with 1"):
        TFTrainer(**{**CREATORS, "data_creator": lambda: None}, config=CONFIG, num_workers=2)


# ----------------------------------------------------- shared trainers


@pytest.fixture(scope="module")
def two_workers(ray_start_4_cpus):
    trainer = TFTrainer(**CREATORS, config=CONFIG, num_workers=2)
    yield trainer
    trainer.shutdown()


@pytest.fixture(scope="module")
def one_worker():
    trainer = TFTrainer(**CREATORS, config=CONFIG, num_workers=0)
    yield trainer
    trainer.shutdown()


def test_two_workers_match_one_worker_stay_in_sync_and_learn(two_workers, one_worker):
    initial = two_workers.apply_all_models(_get_weights)
    assert _max_diff(initial[0], initial[1]) == 0.0
    assert _max_diff(initial[0], one_worker.apply_all_models(_get_weights)[0]) == 0.0

    # Parity: global batch 64 split over 2 workers takes the steps 1 worker takes with 64.
    steps = 12
    two = two_workers.train(num_steps=steps)
    one = one_worker.train(num_steps=steps)
    assert two["num_steps"] == one["num_steps"] == steps
    assert (
        _max_diff(
            two_workers.apply_all_models(_get_weights)[0],
            one_worker.apply_all_models(_get_weights)[0],
        )
        <= 1e-4
    )
    # The reported loss is the mean over the global batch on both (not a sum over workers).
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
    assert two["accuracy"] == pytest.approx(one["accuracy"], abs=1e-6)

    threads_before = two_workers.apply_all_workers(_thread_count)
    epochs = [two_workers.train() for _ in range(3)]
    # A TensorFlow collective timeout starts a thread per collective op that lives for
    # the whole timeout (~8 per step here): over 69 steps they would pile up by hundreds.
    threads_after = two_workers.apply_all_workers(_thread_count)
    assert all(b - a < 20 for a, b in zip(threads_before, threads_after, strict=True)), (
        threads_before,
        threads_after,
    )
    val = two_workers.validate()
    assert [s["epoch"] for s in (two, *epochs)] == [0, 1, 2, 3]
    assert epochs[-1]["loss"] < two["loss"] * 0.5
    assert val["val_accuracy"] > 0.8
    for key in ("loss", "accuracy", "num_samples", "num_steps", "samples_per_s", "epoch_time_s"):
        assert key in epochs[-1], key
    assert epochs[-1]["num_steps"] == 23  # 1437 training samples in global batches of 64
    assert epochs[-1]["num_samples"] == 23 * 64

    weights = two_workers.apply_all_models(_get_weights)
    assert _max_diff(weights[0], weights[1]) == 0.0
    # TF workers never import torch (it would cost every worker ~1 s at start).
    assert two_workers.apply_all_workers(_torch_imported) == [False, False]


def test_checkpoint_round_trip_to_another_worker_count(two_workers, one_worker, tmp_path):
    expected = two_workers.validate()["val_loss"]
    path = tmp_path / "tf.ckpt"
    assert two_workers.save(path) == str(path.resolve())

    one_worker.load(path)  # 2 workers -> 1
    assert one_worker.epoch == two_workers.epoch == 4
    assert one_worker.validate()["val_loss"] == pytest.approx(expected, abs=1e-5)
    state = one_worker.state_dict()
    assert state["framework"] == "tensorflow" and state["world_size"] == 1
    assert int(state["optimizers"][0][0]) == 12 + 3 * 23  # the optimizer's step count came too

    # The driver's copy: built by model_creator outside any strategy, same val loss.
    model = one_worker.get_model()
    _, (x_val, y_val) = tf_digits.load_digits_arrays()
    driver = model.evaluate(x_val, y_val, batch_size=64, verbose=0, return_dict=True)
    assert driver["loss"] == pytest.approx(expected, abs=1e-5)

    # Training continues from the loaded step count and epoch, in step on both sides.
    one_worker.load_state_dict(two_workers.state_dict())
    a, b = two_workers.train(num_steps=2), one_worker.train(num_steps=2)
    assert a["epoch"] == b["epoch"] == 4
    assert (
        _max_diff(
            two_workers.apply_all_models(_get_weights)[0],
            one_worker.apply_all_models(_get_weights)[0],
        )
        <= 1e-4
    )


def _fail_on_rank_one():
    from polytrain.trainer_api.tensorflow import worker as tf_worker

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise ValueError("boom on purpose")
    # Rank 0 trains and blocks in the gradient all-reduce, waiting for rank 1.
    return tf_worker.train_epoch(99, 5)


def test_worker_error_does_not_hang_the_other_and_leaves_no_actors(
    two_workers, one_worker, no_leftover_actors
):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        two_workers.apply_all_workers(_fail_on_rank_one)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert "boom on purpose" in str(info.value)
    with pytest.raises(TrainerShutdownError, match="shut down; create a new one"):
        two_workers.train()
    # one_worker (local mode) holds no Ray resources; its module fixture shuts it down,
    # restoring the worker environment it set in this process outside any test.


def test_max_grad_norm_clips_the_summed_gradient_like_one_process():
    """Keras' global_clipnorm under MWMS clips after the workers' gradients are summed."""
    with pytest.raises(ConfigError, match=r"max_grad_norm=-1"):
        TFTrainer(**CREATORS, config=CONFIG, num_workers=0, max_grad_norm=-1)
    steps, norm = 6, 0.05
    runs = {}
    for name, workers, clip in [("two", 2, norm), ("one", 0, norm), ("free", 0, None)]:
        trainer = TFTrainer(**CREATORS, config=CONFIG, num_workers=workers, max_grad_norm=clip)
        try:
            trainer.train(num_steps=steps)
            runs[name] = trainer.apply_all_models(_get_weights)[0]
        finally:
            trainer.shutdown()
    assert _max_diff(runs["two"], runs["one"]) <= 1e-4
    # The clip is active: the unclipped run moves much further from the same start.
    assert _max_diff(runs["one"], runs["free"]) > 100 * 1e-4
