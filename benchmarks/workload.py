"""The benchmark workload, shared by the native scripts and the polytrain / Ray Train drivers.

Every runner builds the same model, the same generated data (fixed seed), the
same optimizer and runs the same step (forward, loss, zero_grad, backward,
step, ``loss.item()``), and records the same numbers with a
:class:`StepRecorder`: per-step times, the wall-clock time of the first
completed step, and the process's resident memory. Only the launcher and the
distributed wrapper differ between runners, which is what the benchmark measures.

This module imports no distributed framework; TensorFlow parts import
TensorFlow inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------ memory
def current_rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (``ru_maxrss``), in MiB.

    After :meth:`StepRecorder.setup_done` reset the high-water mark, this is the peak
    since then; :meth:`StepRecorder.summary` reports the maximum of both.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hwm_rss_mb() -> float | None:
    """The resident high-water mark (``VmHWM`` of /proc/self/status), in MiB; None if absent."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reset_hwm() -> bool:
    """Reset the resident high-water mark to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------- recorder
class StepRecorder:
    """Per-process timing and memory record, written as JSON at the end of a run.

    ``marks`` are wall-clock (``time.time()``) timestamps of named phases, so the
    orchestrator can subtract its own launch timestamp; step durations use
    ``time.perf_counter()``.
    """

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.step_s: list[float] = []
        self.ends: list[float] = []
        self.baseline_rss_mb: float | None = None
        self.setup_peak_rss_mb: float | None = None
        self.setup_rss_mb: float | None = None
        self.hwm_reset = False

    def mark(self, name: str) -> None:
        """Record the wall-clock time of a named phase (the first call per name wins)."""
        self.marks.setdefault(name, time.time())

    def before_model(self) -> None:
        """Call right before the model is built: the baseline of the memory delta."""
        if self.baseline_rss_mb is None:
            self.baseline_rss_mb = current_rss_mb()
        self.mark("model_build")

    def setup_done(self) -> None:
        """Call after the model is wrapped, before the first step: the set-up peak.

        Records the high-water mark so far (model build, broadcast, sharding) and resets
        it, so that the peak at the end of the run is the training peak alone.
        """
        if self.setup_peak_rss_mb is not None:
            return
        self.setup_peak_rss_mb = hwm_rss_mb() or peak_rss_mb()
        self.setup_rss_mb = current_rss_mb()
        self.hwm_reset = reset_hwm()
        self.mark("setup_done")

    def record(self, start: float, end: float) -> None:
        """Record one step that ran from ``start`` to ``end`` (``perf_counter`` values)."""
        self.step_s.append(end - start)
        self.ends.append(end)
        if len(self.step_s) == 1:
            self.mark("first_step")

    def restart_steps(self) -> None:
        """Forget the steps recorded so far (the marks stay): the steady state starts now."""
        self.step_s.clear()
        self.ends.clear()

    def summary(self, rank: int) -> dict[str, Any]:
        """Everything recorded, plus the process's peak memory and scheduling facts."""
        torch = sys.modules.get("torch")  # not imported just to ask (TensorFlow runs)
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        train_peak = (hwm_rss_mb() or peak_rss_mb()) if self.hwm_reset else None
        return {
            "rank": rank,
            "pid": os.getpid(),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "torch_threads": torch.get_num_threads() if torch is not None else None,
            "python_threads": threading.active_count(),
            "marks": self.marks,
            "step_s": self.step_s,
            # End of step i-1 to end of step i: includes data loading and loop overhead.
            "interval_s": intervals,
            "baseline_rss_mb": self.baseline_rss_mb,
            # ru_maxrss follows the reset of setup_done(): the whole run's peak is the larger.
            "peak_rss_mb": max(peak_rss_mb(), self.setup_peak_rss_mb or 0.0, train_peak or 0.0),
            "setup_peak_rss_mb": self.setup_peak_rss_mb,
            "setup_rss_mb": self.setup_rss_mb,
            "train_peak_rss_mb": train_peak,
            "final_rss_mb": current_rss_mb(),
        }


#: The recorder of this process (native scripts, and polytrain / Ray Train workers).
RECORDER = StepRecorder()


def write_summary(result_dir: str | os.PathLike, rank: int, extra: dict | None = None) -> None:
    """Write this process's summary to ``result_dir/rank{rank}.json``."""
    data = RECORDER.summary(rank)
    data.update(extra or {})
    path = Path(result_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(data))


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
