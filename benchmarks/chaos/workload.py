"""The chaos run's workload: creators that log every step, for TorchTrainer and TFTrainer.

Both frameworks train the same generated data set (256 samples of 8 features, two
classes) in global batches of 32: 8 optimizer steps per epoch with any world size.
The torch model has dropout (so an exact resume needs the random states restored)
and SGD with momentum (so it needs the optimizer state too); the Keras model is the
same MLP without dropout (TFTrainer does not restore TensorFlow's random streams).

What the run is judged by, written by the workers themselves:

* ``steps.log``: rank 0 appends ``<unix time> <global step>`` after every optimizer
  step it completes (1-based, counted from the start of training and restored with
  the checkpoint): a step logged twice was trained twice, i.e. lost once.
* ``rank_<r>.json``: every worker process writes its rank, pid and node at its first
  step, so the fault injector can find the process (or node) that holds a rank now.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: Samples, features and the global batch of the data set: 8 steps per epoch.
SAMPLES, FEATURES, GLOBAL_BATCH = 256, 8, 32
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
STEPS_LOG = "steps.log"


def _arrays() -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int64)
    return x, y


# ------------------------------------------------------------ what workers record
def announce(log_dir: str, rank: int) -> None:
    """Write ``rank_<rank>.json``: this process's pid and node (atomically: the injector reads it)."""
    import ray

    record = {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "time": time.time(),
    }
    path = Path(log_dir) / f"rank_{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def log_step(log_dir: str, step: int) -> None:
    """Append ``<time> <step>`` to the steps log (rank 0, after the step completed)."""
    with open(Path(log_dir) / STEPS_LOG, "a") as log:
        log.write(f"{time.time():.6f} {int(step)}\n")


# --------------------------------------------------------------------- torch
def torch_model_creator(config: dict) -> Any:
    """An MLP with dropout, the same initial weights everywhere."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(32, 2),
    )


def torch_data_creator(config: dict) -> Any:
    """The shuffled training loader (the distributed sampler shuffles per epoch, seeded)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _arrays()
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return DataLoader(data, batch_size=config["batch_size"], shuffle=True)


def torch_optimizer_creator(model: Any, config: dict) -> Any:
    """SGD with momentum: its buffers are part of what a resume must restore."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)


def torch_operator_cls() -> type:
    """A TrainingOperator whose steps take ``config["step_sleep_s"]`` longer and are logged."""
    from polytrain import TrainingOperator

    class LoggedSteps(TrainingOperator):
        """Announces the process at its first step; rank 0 logs every completed step."""

        announced = False

        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            log_dir = self.config["chaos_log_dir"]
            if not self.announced:
                announce(log_dir, self.world_rank)
                self.announced = True
            time.sleep(self.config.get("step_sleep_s", 0.0))
            result = super().train_batch(batch, batch_info)
            if self.world_rank == 0:
                step = batch_info["epoch_idx"] * STEPS_PER_EPOCH + batch_info["batch_idx"] + 1
                log_step(log_dir, step)
            return result

    return LoggedSteps


# ---------------------------------------------------------------- TensorFlow
def tf_model_creator(config: dict) -> Any:
    """The same MLP (no dropout) in tf_keras; its train step logs like the torch operator."""
    import tensorflow as tf

    from polytrain.compat.keras import get_keras

    keras = get_keras()
    keras.utils.set_random_seed(0)
    log_dir, sleep_s = config["chaos_log_dir"], float(config.get("step_sleep_s", 0.0))
    rank = int(json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0))
    announced: list[bool] = []

    def after_step(iterations: Any) -> None:
        if not announced:
            announce(log_dir, rank)
            announced.append(True)
        time.sleep(sleep_s)
        if rank == 0:
            log_step(log_dir, int(iterations))

    class LoggedSteps(keras.Sequential):
        """A Sequential model whose train step ends by logging the optimizer's step count."""

        def train_step(self, data: Any) -> Any:
            result = super().train_step(data)
            with tf.control_dependencies(tf.nest.flatten(result)):
                tf.py_function(after_step, [self.optimizer.iterations], [])
            return result

    model = LoggedSteps(
        [
            keras.Input(shape=(FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=config.get("lr", 0.1), momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,  # the step calls back into Python (py_function): no XLA
    )
    return model


def tf_data_creator(config: dict) -> Any:
    """The data set in a fixed order (``tf.data`` reshuffles per iterator: no shuffle for exactness)."""
    import tensorflow as tf

    x, y = _arrays()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(config["batch_size"])
