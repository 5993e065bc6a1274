"""The MLP workload, shared by the native scripts and the polytrain / Ray Train drivers.

Every runner builds the same model, the same generated data (fixed seed), the
same optimizer and runs the same step (forward, loss, zero_grad, backward,
step, ``loss.item()``), and records the same numbers with the process's
:data:`~benchmarks.workloads.recorder.RECORDER`. Only the launcher and the
distributed wrapper differ between runners, which is what the benchmark measures.
The models: the MLP 784-512-512-10 (``"mlp"``), a deep stack of wide layers whose
optimizer state dominates the memory (``"big"``), and the same MLP in Keras.

This module imports no distributed framework; TensorFlow parts import
TensorFlow inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from benchmarks.workloads.recorder import RECORDER

#: Global batch (split evenly between the workers) and worker count of every run.
GLOBAL_BATCH = 64
NUM_WORKERS = 2
SEED = 0
LR = 1e-3


@dataclasses.dataclass
class WorkloadSpec:
    """What to train and for how long; travels to every process as JSON.

    Attributes:
        model: "mlp" (784-512-512-10, 10 classes) or "big" (``layers`` x
            Linear(width, width) with ReLU, then Linear(width, 10)): a model whose
            optimizer state dominates the memory (run.py uses 12 x 2000 by default: 20 x 2000
            takes too long for a 25-minute run on 2 cores; --big-layers 20 restores it).
        layers: hidden layers of the "big" model.
        width: width of the "big" model.
        steps: training steps per worker (the data set holds exactly this many batches).
        warmup: steps left out of the steady-state statistics.
        optimizer: "adam" (its two state tensors per parameter are what ZeRO shards).
    """

    model: str = "mlp"
    layers: int = 20
    width: int = 2000
    steps: int = 300
    warmup: int = 20
    optimizer: str = "adam"

    def to_json(self) -> str:
        """The spec as a JSON string (for a command line)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkloadSpec:
        """Parse :meth:`to_json`'s output."""
        return cls(**json.loads(text))

    @property
    def in_features(self) -> int:
        """Input width of the model."""
        return 784 if self.model == "mlp" else self.width

    def num_params(self) -> int:
        """Parameter count P of the model (for the ZeRO memory formulas)."""
        if self.model == "mlp":
            return 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
        return self.layers * (self.width * self.width + self.width) + self.width * 10 + 10


# ------------------------------------------------------------ torch parts
def build_model(spec: WorkloadSpec) -> Any:
    """The model, with the same initial weights in every process (seeded)."""
    import torch

    RECORDER.before_model()
    torch.manual_seed(SEED)
    if spec.model == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(784, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
    layers: list[Any] = []
    for _ in range(spec.layers):
        layers += [torch.nn.Linear(spec.width, spec.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(spec.width, 10))
    return torch.nn.Sequential(*layers)


def make_dataset(spec: WorkloadSpec) -> Any:
    """Generated classification data: ``steps`` global batches (fixed seed)."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    n = spec.steps * GLOBAL_BATCH
    features = torch.randn(n, spec.in_features, generator=gen)
    target = torch.randint(0, 10, (n,), generator=gen)
    return torch.utils.data.TensorDataset(features, target)


def make_loader(spec: WorkloadSpec, rank: int, world_size: int) -> Any:
    """This rank's loader: a DistributedSampler share, per-worker batch ``GLOBAL_BATCH / world``."""
    import torch
    from torch.utils.data.distributed import DistributedSampler

    dataset = make_dataset(spec)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=SEED)
    return torch.utils.data.DataLoader(
        dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler, drop_last=True
    )


def make_optimizer(model: Any, spec: WorkloadSpec) -> Any:
    """The optimizer (Adam unless the spec says "sgd")."""
    import torch

    if spec.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=LR)


def run_steps(
    loader: Any,
    step_fn: Any,
    num_steps: int,
) -> None:
    """Run ``step_fn(features, target)`` on up to ``num_steps`` batches, recording each step.

    ``step_fn`` must end with ``loss.item()`` (a host sync), so the recorded time
    covers the whole step.
    """
    for index, (features, target) in enumerate(loader):
        if index >= num_steps:
            break
        start = time.perf_counter()
        step_fn(features, target)
        RECORDER.record(start, time.perf_counter())


# ------------------------------------------------------- polytrain creators
def spec_from_config(config: dict[str, Any]) -> WorkloadSpec:
    """The spec a trainer's ``config`` carries under ``"spec"``."""
    return WorkloadSpec.from_json(config["spec"])


def pt_model_creator(config: dict[str, Any]) -> Any:
    """polytrain ``model_creator``."""
    return build_model(spec_from_config(config))


def pt_data_creator(config: dict[str, Any]) -> Any:
    """polytrain ``data_creator``: the full data set; polytrain adds the DistributedSampler."""
    import torch

    spec = spec_from_config(config)
    return torch.utils.data.DataLoader(
        make_dataset(spec), batch_size=config["batch_size"], drop_last=True
    )


def pt_optimizer_creator(model: Any, config: dict[str, Any]) -> Any:
    """polytrain ``optimizer_creator``."""
    return make_optimizer(model, spec_from_config(config))


# ------------------------------------------------------------ TensorFlow
def tf_build_model(spec: WorkloadSpec) -> Any:
    """The Keras (tf_keras) MLP, compiled with Adam; same layer sizes as the torch MLP."""
    import tf_keras as keras

    RECORDER.before_model()
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def tf_dataset(spec: WorkloadSpec) -> Any:
    """Generated data batched with the global batch (MultiWorkerMirroredStrategy splits it)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(SEED + 1)
    n = spec.steps * GLOBAL_BATCH
    features = rng.standard_normal((n, 784), dtype=np.float32)
    target = rng.integers(0, 10, size=(n,)).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((features, target)).batch(
        GLOBAL_BATCH, drop_remainder=True
    )


#: Epochs of ``spec.steps`` batches the Keras runners train; the step statistics come
#: from the last one. The first epoch of a fresh process holds tf.function tracing, the
#: collectives' first group and instance set-up, and (for Ray-based runners) the local
#: Ray instance's own start-up work: launch costs, not the steady state.
TF_EPOCHS = 2


def tf_timing_callback() -> Any:
    """A Keras callback that records the end of every training batch of the last epoch.

    It keeps Keras's logs as tensors (``_supports_tf_logs``) so it adds no host
    sync, as polytrain's own progress callback does. The first batch end of the
    first epoch is still recorded (the launch-to-first-step mark).
    """
    import tf_keras as keras

    class Timing(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True
            self._last = time.perf_counter()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch > 0:
                RECORDER.restart_steps()

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._last = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            RECORDER.record(self._last, time.perf_counter())

    return Timing()
