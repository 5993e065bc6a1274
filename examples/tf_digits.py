"""TensorFlow quick start: classify scikit-learn's 8x8 digits with TFTrainer (no download).

Run it:  python examples/tf_digits.py --num-workers 2 --epochs 5

The creators below are what a polytrain user writes. ``config["batch_size"]`` is
the global batch: the data sets are batched with it and MultiWorkerMirroredStrategy
splits every batch between the workers.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SEED = 0


def load_digits_arrays(test_fraction: float = 0.2) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The digits data as float features in [0, 1] and integer labels, split train/val."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * (1 - test_fraction))
    return (x[:split], y[:split]), (x[split:], y[split:])


def model_creator(config: dict):
    """A small compiled MLP, 64 -> hidden -> 10, built with tf_keras (Keras 2)."""
    import tf_keras as keras

    keras.utils.set_random_seed(config.get("seed", SEED))  # same initial weights everywhere
    model = keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(config.get("hidden", 64), activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=config.get("lr", 0.1), momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data_creator(config: dict):
    """Train and validation data sets batched with the global ``config["batch_size"]``.

    ``shuffle=False`` in ``config`` keeps the order fixed (for exact comparisons).
    """
    import tensorflow as tf

    (x_train, y_train), (x_val, y_val) = load_digits_arrays()
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    if config.get("shuffle", True):
        # The same seed on every worker: each must see the same global batches.
        train = train.shuffle(len(x_train), seed=config.get("seed", SEED))
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    return train.batch(config["batch_size"]), val.batch(config["batch_size"])


def main() -> None:
    """Train and validate from the command line."""
    # Set before TensorFlow is imported, so that `tf.keras` in this process is tf_keras too.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    from polytrain import TFTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--communication", default="auto", choices=["auto", "ring", "nccl"])
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--checkpoint", default="tf_digits.ckpt.pt")
    args = parser.parse_args()

    trainer = TFTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        config={"lr": args.lr, "batch_size": args.batch_size},
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        backend="mwms",
        backend_config={"communication": args.communication},
        use_tqdm=True,
    )
    try:
        for _ in range(args.epochs):
            stats = trainer.train()
            val = trainer.validate()
            print(
                f"epoch {stats['epoch']}: loss {stats['loss']:.4f}  "
                f"accuracy {stats['accuracy']:.3f}  val_loss {val['val_loss']:.4f}  "
                f"val_accuracy {val['val_accuracy']:.3f}  {stats['samples_per_s']:.0f} samples/s"
            )
        print("checkpoint:", trainer.save(args.checkpoint))
        model = trainer.get_model()
        print("driver model:", type(model).__name__, model.count_params(), "parameters")
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
