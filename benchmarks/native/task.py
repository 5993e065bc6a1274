"""One interface over the two workloads for the native scripts: the MLP and the GPT-2.

A native script parses its ``--spec`` with :func:`load_task` and asks the task
for the model, optimizer, loader and loss; the spec's ``model`` field picks the
workload ("gpt2": :mod:`benchmarks.workloads.gpt2`, else :mod:`benchmarks.workloads.mlp`),
so the same scripts serve both benchmarks and stay written once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.workloads import gpt2, mlp, recorder


class Task:
    """The workload a native script trains: model, data, optimizer and the loss of a batch."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.lm = isinstance(spec, gpt2.LMSpec)
        self._module = gpt2 if self.lm else mlp
        self._criterion: Any = None

    def build_model(self) -> Any:
        """The seeded model (the recorder's memory baseline is taken right before)."""
        return self._module.build_model(self.spec)

    def make_optimizer(self, model: Any) -> Any:
        """The workload's optimizer over ``model``'s parameters."""
        return self._module.make_optimizer(model, self.spec)

    def make_loader(self, rank: int, world_size: int) -> Any:
        """This rank's loader (a DistributedSampler share)."""
        return self._module.make_loader(self.spec, rank, world_size)

    def micro_batch(self, world_size: int) -> int:
        """Samples per worker per step."""
        return self.spec.batch if self.lm else mlp.GLOBAL_BATCH // world_size

    def loss(self, model: Any, batch: Any) -> Any:
        """The loss of ``batch``: the LM's own, or cross-entropy of the MLP's logits."""
        if self.lm:
            return gpt2.loss(model, batch)
        if self._criterion is None:
            import torch

            self._criterion = torch.nn.CrossEntropyLoss()
        features, target = batch
        return self._criterion(model(features), target)

    def block_classes(self, model: Any) -> tuple[type, ...]:
        """The GPT-2 block class (what FSDP and polytrain's "auto" policy shard by); () for the MLP."""
        if not self.lm:
            return ()
        return (type(model.transformer.h[0]),)

    def run(self, loader: Any, step_fn: Any) -> None:
        """``step_fn(batch)`` on up to ``spec.steps`` batches, each timed by the recorder.

        Marks the end of the set-up first (the set-up memory peak). ``step_fn`` must end
        with ``loss.item()`` (a host sync), so the recorded time covers the whole step.
        """
        recorder.RECORDER.setup_done()
        for index, batch in enumerate(loader):
            if index >= self.spec.steps:
                break
            start = time.perf_counter()
            step_fn(batch)
            recorder.RECORDER.record(start, time.perf_counter())


def load_task(text: str) -> Task:
    """The task of a ``--spec`` JSON string (an :class:`LMSpec` when its model is "gpt2")."""
    if json.loads(text).get("model") == "gpt2":
        return Task(gpt2.LMSpec.from_json(text))
    return Task(mlp.WorkloadSpec.from_json(text))
