"""Ray Train's ``v2/tests/test_tensorflow_trainer.py``, on ``polytrain.train`` (Ray Train, Apache-2.0).

Same test: a Keras linear regression trained by ``TensorflowTrainer`` on one and two
workers from a Ray Data set (``datasets={TRAIN_DATASET_KEY: ...}``, read with
``get_dataset_shard`` and ``to_tf``) with the Keras ``ReportCheckpointCallback``; the
result has no error and a checkpoint.

Fixture changes: the session's shared Ray instance; the data is generated here
(Ray's reads a 100-column CSV from S3, which needs the network) as the same shape of
problem (``x`` of 100 features, ``y`` linear in them); Ray's example
``tensorflow_regression_example.train_func`` is written here as :func:`regression_train_func`.
Both cases are ``long_matrix`` (TensorFlow's start-up makes each take about a minute).
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

from polytrain import train
from polytrain.train import ScalingConfig
from polytrain.train.constants import TRAIN_DATASET_KEY
from polytrain.train.tensorflow import TensorflowTrainer

pytestmark = [pytest.mark.usefixtures("ray_start_4_cpus"), pytest.mark.long_matrix]
pytest.importorskip("tensorflow")


def regression_train_func(config: dict) -> list:
    import tensorflow as tf

    from polytrain.train.tensorflow.keras import ReportCheckpointCallback

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input(shape=(100,)), tf.keras.layers.Dense(10), tf.keras.layers.Dense(1)]
        )
        model.compile(optimizer=tf.keras.optimizers.Adam(config["lr"]), loss="mse")
    shard = train.get_dataset_shard("train")
    results = []
    for _ in range(config["epochs"]):
        tf_dataset = shard.to_tf(
            feature_columns="x", label_columns="y", batch_size=config["batch_size"]
        )
        history = model.fit(tf_dataset, callbacks=[ReportCheckpointCallback()], verbose=0)
        results.append(history.history)
    return results


@pytest.mark.parametrize("num_workers", [1, 2])
def test_tensorflow_linear(num_workers):
    epochs = 1

    def train_func(config):
        assert len(regression_train_func(config)) == epochs

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 100)).astype("float32")
    y = (x @ rng.normal(size=100) + 0.5).astype("float32")
    dataset = ray.data.from_items(
        [{"x": row, "y": target} for row, target in zip(x, y, strict=True)]
    )
    result = TensorflowTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={"lr": 1e-3, "batch_size": 32, "epochs": epochs},
        scaling_config=ScalingConfig(num_workers=num_workers),
        datasets={TRAIN_DATASET_KEY: dataset},
    ).fit()
    assert not result.error
    assert result.checkpoint
