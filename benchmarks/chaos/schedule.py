"""The chaos run's fault schedule: the fault kinds, a seeded schedule of them, and the steps each may cost.

A schedule is a list of ``(step, fault kind, target rank)``: the kinds in rounds
(each round every kind once, shuffled), a fixed number of steps apart plus jitter,
the same for every backend of a run. :func:`designed_loss` is the bound a fault's
lost steps are judged by.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.chaos.workload import STEPS_PER_EPOCH

#: The fault kinds (described in :mod:`benchmarks.chaos.suite`), in the report's order.
KINDS = (
    "kill_worker",
    "hang_worker",
    "remove_node",
    "drain_deadline",
    "drain_no_deadline",
    "driver_sigterm",
)
#: Faults announced before they strike (drains, the driver's SIGTERM): by design they cost no step.
ANNOUNCED = ("drain_deadline", "drain_no_deadline", "driver_sigterm")
#: Faults that take the target rank's whole node.
NODE_KINDS = ("remove_node", "drain_deadline", "drain_no_deadline")
#: The cases of a full run: every torch backend, and TFTrainer (``mwms``).
TORCH_CASES = ("ddp", "horovod", "fairscale", "fsdp", "deepspeed")
ALL_CASES = (*TORCH_CASES, "mwms")
#: Workers of every group (one per worker node: SPREAD over two 2-CPU nodes).
NUM_WORKERS = 2


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: at global step ``step`` (1-based), ``kind`` hits rank ``rank`` (or its node)."""

    step: int
    kind: str
    rank: int
    graceful: bool = False  # remove_node: let the node's processes shut down first


def make_schedule(
    num_faults: int, seed: int, kinds: tuple[str, ...] = KINDS, first: int = 12, gap: int = 10
) -> list[Fault]:
    """A seeded schedule: the kinds in rounds (each round every kind once, shuffled), ``gap`` steps apart plus jitter."""
    rng = random.Random(seed)
    order: list[str] = []
    faults = []
    for i in range(num_faults):
        if not order:
            order = rng.sample(list(kinds), len(kinds))
        kind = order.pop()
        step = first + i * gap + rng.randrange(max(1, gap // 2))
        graceful = kind == "remove_node" and rng.random() < 0.5
        faults.append(Fault(step, kind, rng.randrange(NUM_WORKERS), graceful))
    return faults


def designed_loss(kind: str, framework: str, every_n_steps: int) -> int:
    """The most steps a fault of ``kind`` may cost by design.

    Torch trainers checkpoint every ``every_n_steps`` and leave a draining node at a
    step. TFTrainer's calls are whole epochs, checkpointed at their ends: a lost worker
    costs the epoch so far, and a draining node is left when the running epoch ends
    (nothing lost while the deadline is further away than that). Announced faults: 0.
    """
    if kind in ANNOUNCED:
        return 0
    return every_n_steps if framework == "torch" else STEPS_PER_EPOCH


def framework_of(case: str) -> str:
    """``tensorflow`` for the TFTrainer case, else ``torch``."""
    return "tensorflow" if case in ("mwms", "tensorflow", "tf") else "torch"
