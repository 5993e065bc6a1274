"""Ray Train's two Keras CNNs under TFTrainer (MultiWorkerMirroredStrategy), on generated data.

Run them:  python examples/keras_cnns.py --model mnist --num-workers 2 --epochs 3
           python examples/keras_cnns.py --model image --num-workers 2 --epochs 1

``mnist``: the LeNet-style CNN of Ray Train's ``tensorflow_mnist_example`` (Conv2D 32
3x3 -> MaxPool -> Flatten -> Dense 128 -> Dense 10) on MNIST-shaped 28x28x1 images.
``image``: a small CNN on 224x224x3 images, the input size of Ray Train's Keras image
examples. Ray Train's versions build the model inside their own loop under
``strategy.scope()``; here the same model is a creator, and ``TFTrainer`` calls it
inside the strategy's scope on every worker.

Nothing is downloaded: both data sets are generated with a fixed seed (each class a
pattern of its own plus noise), so every worker builds the same batches and the
networks learn within an epoch or two. ``config["batch_size"]`` is the global batch.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SEED = 0


def generated_images(
    num_samples: int, shape: tuple[int, int, int], num_classes: int, seed: int = SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Images of ``shape`` (height, width, channels) in [0, 1] and integer labels.

    Each class is a coarse pattern of its own (a 7x7 grid, scaled up to the image
    size); each image is its class's pattern plus noise.
    """
    height, width, channels = shape
    patterns = np.random.default_rng(SEED).random((num_classes, 7, 7, channels))
    patterns = np.repeat(np.repeat(patterns, -(-height // 7), axis=1), -(-width // 7), axis=2)
    patterns = patterns[:, :height, :width, :]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_samples)
    noise = rng.normal(0.0, 0.3, (num_samples, height, width, channels))
    images = np.clip(patterns[labels] + noise, 0.0, 1.0).astype(np.float32)
    return images, labels.astype(np.int64)


def _datasets(config: dict, shape: tuple[int, int, int], num_classes: int, sizes: tuple[int, int]):
    import tensorflow as tf

    x_train, y_train = generated_images(config.get("num_train", sizes[0]), shape, num_classes)
    x_val, y_val = generated_images(config.get("num_val", sizes[1]), shape, num_classes, SEED + 1)
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    # The same seed on every worker: each must see the same global batches.
    train = train.shuffle(len(x_train), seed=config.get("seed", SEED))
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    return train.batch(config["batch_size"]), val.batch(config["batch_size"])


def mnist_cnn_creator(config: dict):
    """Ray Train's MNIST CNN, compiled with SGD: 28x28x1 -> Conv2D 32 3x3 -> ... -> 10 logits."""
    import tf_keras as keras

    keras.utils.set_random_seed(config.get("seed", SEED))  # same initial weights everywhere
    model = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=config.get("lr", 0.05), momentum=config.get("momentum", 0.9)
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def mnist_data_creator(config: dict):
    """MNIST-shaped train and validation sets (28x28x1, 10 classes), global batches."""
    return _datasets(config, (28, 28, 1), 10, sizes=(2048, 512))


def image_cnn_creator(config: dict):
    """A small CNN on 224x224x3 images, compiled with Adam: two strided convolutions, pooled."""
    import tf_keras as keras

    keras.utils.set_random_seed(config.get("seed", SEED))
    model = keras.Sequential(
        [
            keras.Input(shape=(224, 224, 3)),
            keras.layers.Conv2D(16, 7, strides=4, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(config.get("num_classes", 4)),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=config.get("lr", 1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def image_data_creator(config: dict):
    """A few 224x224x3 images (``config["num_classes"]`` classes, default 4), global batches."""
    return _datasets(config, (224, 224, 3), config.get("num_classes", 4), sizes=(64, 16))


CREATORS = {
    "mnist": (mnist_cnn_creator, mnist_data_creator),
    "image": (image_cnn_creator, image_data_creator),
}


def main() -> None:
    """Train and validate one of the two models from the command line."""
    # Set before TensorFlow is imported, so that `tf.keras` in this process is tf_keras too.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    from polytrain import TFTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CREATORS), default="mnist")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, help="the global batch (default 64, image 8)")
    parser.add_argument("--lr", type=float, help="default 0.05 (SGD, mnist), 1e-3 (Adam, image)")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()

    model_creator, data_creator = CREATORS[args.model]
    config = {"batch_size": args.batch_size or (64 if args.model == "mnist" else 8)}
    if args.lr is not None:
        config["lr"] = args.lr
    trainer = TFTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        config=config,
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        backend="mwms",
        use_tqdm=True,
    )
    try:
        for _ in range(args.epochs):
            stats = trainer.train()
            val = trainer.validate()
            print(
                f"epoch {stats['epoch']}: loss {stats['loss']:.4f}  "
                f"accuracy {stats['accuracy']:.3f}  val_loss {val['val_loss']:.4f}  "
                f"val_accuracy {val['val_accuracy']:.3f}"
            )
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
