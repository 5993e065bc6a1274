"""Ray Data input on real TensorFlow workers: TFTrainer(datasets=...) (issue 16.2).

Two MWMS workers train the digits data from ``ray.data.from_items`` and from a
parquet file, and match the ``data_creator`` (tf.data) path on the same rows.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from examples import tf_digits
from polytrain import TFTrainer
from polytrain.errors import ConfigError, ConfigTypeError, CreatorError

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

# Every test starts with an empty warm pool: Ray Data's read tasks need the CPUs idle pooled workers would hold.
KEEP_WARM_POOL = False

# No shuffling on either path: the same rows in the same order.
CONFIG = {"lr": 0.05, "batch_size": 64, "shuffle": False}
EPOCHS = 3
# A hang in a collective becomes an error instead of a stuck test.
FAILURE = {"hang_timeout_s": 60, "max_retries": 0}


@pytest.fixture(scope="module", autouse=True)
def tensorflow_imported():
    """Import TensorFlow before the per-test environment guard takes its snapshot."""
    import tensorflow  # noqa: F401
    import tf_keras  # noqa: F401


def _items(x: np.ndarray, y: np.ndarray) -> list[dict]:
    return [{"x": row, "y": label} for row, label in zip(x, y, strict=True)]


def _digits_datasets() -> dict:
    import ray

    (x_train, y_train), (x_val, y_val) = tf_digits.load_digits_arrays()
    # A few blocks, as real data sets of this size have (from_items alone makes 200).
    # 1437 training rows: odd, so equal splits drop one, and 718 per worker is no multiple
    # of the batch. 360 validation rows in 3 blocks: the validation split (every row
    # once, whole blocks) gives one worker twice the rows of the other.
    return {
        "train": ray.data.from_items(_items(x_train, y_train), override_num_blocks=4),
        "val": ray.data.from_items(_items(x_val, y_val), override_num_blocks=3),
    }


def _torch_imported() -> bool:
    import sys

    return "torch" in sys.modules


def _train(epochs: int = EPOCHS, check=None, **data) -> list[dict]:
    trainer = TFTrainer(
        model_creator=tf_digits.model_creator,
        config=CONFIG,
        num_workers=2,
        failure_config=FAILURE,
        **data,
    )
    try:
        stats = [trainer.train() for _ in range(epochs)]
        stats.append(trainer.validate())
        if check is not None:
            stats.append(trainer.apply_all_workers(check))
            # The trained model evaluated in the driver on every validation row.
            _, (x_val, y_val) = tf_digits.load_digits_arrays()
            model = trainer.get_model()
            stats.append(model.evaluate(x_val, y_val, verbose=0, return_dict=True))
        return stats
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def reference():
    """The data_creator (tf.data) path: the same model, rows, batch and epochs."""
    return _train(data_creator=tf_digits.data_creator)


@pytest.fixture(scope="module")
def from_items():
    """The Ray Data path on the same rows: stats of every call, and its wall time."""
    start = time.monotonic()
    stats = _train(datasets=_digits_datasets(), check=_torch_imported)
    return stats, time.monotonic() - start


def test_a_ray_dataset_trains_like_the_tf_data_path(reference, from_items):
    stats, _ = from_items
    losses = [s["loss"] for s in stats[:EPOCHS]]
    expected = [s["loss"] for s in reference[:EPOCHS]]
    assert losses[-1] < losses[0] * 0.6, (losses, expected)  # it trained
    # As the tf.data path did (another row order per step, a few rows dropped: noise).
    assert losses[-1] == pytest.approx(expected[-1], rel=0.25), (losses, expected)
    val, ref_val = stats[EPOCHS], reference[EPOCHS]
    assert val["val_loss"] == pytest.approx(ref_val["val_loss"], rel=0.25), (val, ref_val)
    assert val["val_accuracy"] == pytest.approx(ref_val["val_accuracy"], abs=0.08)
    # Ray Data's numpy batches reach TensorFlow without importing torch in the workers.
    assert stats[EPOCHS + 1] == [False, False]


def test_the_global_batch_rule_holds_and_uneven_rows_do_not_hang(reference, from_items):
    stats, elapsed = from_items
    # Hangs would have become errors (hang_timeout_s); the whole run stays well below.
    assert elapsed < 180
    train_rows = len(tf_digits.load_digits_arrays()[0][0])
    # Each worker reads its split (718 rows) in global batches of 64, full ones only, and
    # the strategy cuts each into 2 steps of 32 rows: 64 rows per step across the workers,
    # about as many steps as the tf.data path takes (23, its last batch partial).
    full_batches = (train_rows // 2) // CONFIG["batch_size"]
    assert [s["num_steps"] for s in stats[:EPOCHS]] == [2 * full_batches] * EPOCHS
    assert stats[0]["num_samples"] == 2 * full_batches * CONFIG["batch_size"]
    assert reference[0]["num_steps"] == -(-train_rows // CONFIG["batch_size"])
    # The uneven validation splits ran to the end on both workers and counted every row
    # once: the same loss as the trained model's on all 360 rows in the driver.
    assert stats[EPOCHS]["val_loss"] == pytest.approx(stats[-1]["loss"], rel=1e-4)
    assert stats[EPOCHS]["val_accuracy"] == pytest.approx(stats[-1]["accuracy"], abs=1e-6)


def test_a_parquet_file_trains_through_read_parquet(reference, tmp_path):
    import ray

    datasets = _digits_datasets()
    # One file: one read task per epoch (each epoch reads the file again, streaming).
    datasets["train"].repartition(1).write_parquet(str(tmp_path / "train"))
    train = ray.data.read_parquet(str(tmp_path / "train"))
    assert len(list((tmp_path / "train").glob("*.parquet"))) == 1
    # Two epochs: Ray Data re-reads the file at each (seconds apiece on a small machine).
    stats = _train(epochs=2, datasets={"train": train, "val": datasets["val"]})
    assert stats[1]["loss"] == pytest.approx(reference[1]["loss"], rel=0.25), (stats, reference)
    assert stats[1]["loss"] < stats[0]["loss"] * 0.6
    assert stats[2]["val_accuracy"] > 0.8


def test_bad_datasets_and_columns_are_refused_before_any_worker_starts():
    import ray

    dataset = ray.data.from_items([{"x": np.zeros(64, np.float32), "y": 0}] * 8)
    common = {"model_creator": tf_digits.model_creator, "config": CONFIG, "num_workers": 2}
    with pytest.raises(ConfigError, match="'train' required"):
        TFTrainer(**common, datasets={"valid": dataset})
    with pytest.raises(ConfigTypeError, match=r"datasets\['train'\] must be a ray.data.Dataset"):
        TFTrainer(**common, datasets={"train": tf_digits.data_creator})
    with pytest.raises(ConfigTypeError, match="tf.data datasets through data_creator"):
        TFTrainer(**common, datasets={"train": [1, 2]})
    with pytest.raises(ConfigError, match="Both data_creator and datasets"):
        TFTrainer(**common, datasets={"train": dataset}, data_creator=tf_digits.data_creator)
    with pytest.raises(ConfigError, match=r"names \['label'\], which the data set does not"):
        TFTrainer(**common, datasets={"train": dataset}, dataset_columns={"label": "label"})
    val = ray.data.from_items([{"x": np.zeros(64, np.float32)}] * 8)
    with pytest.raises(ConfigError, match=r"datasets\['val'\] lacks the columns \['y'\]"):
        TFTrainer(**common, datasets={"train": dataset, "val": val})
    with pytest.raises(ConfigError, match="auto_shard_policy='file' does not apply"):
        TFTrainer(
            **common, datasets={"train": dataset}, backend_config={"auto_shard_policy": "file"}
        )


def test_a_ray_dataset_from_data_creator_says_to_pass_it_to_the_trainer():
    import ray

    def creator(config):
        return ray.data.from_items([{"x": np.zeros(64, np.float32), "y": 0}])

    # Local mode: the same worker code in this process, the error arrives unchanged.
    with pytest.raises(CreatorError, match=r"a Ray Dataset: .*TFTrainer\(\.\.\., datasets="):
        TFTrainer(
            model_creator=tf_digits.model_creator,
            data_creator=creator,
            config=CONFIG,
            num_workers=0,
        )
