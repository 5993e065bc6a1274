"""The mesh-parallel benchmark's workload (issue 42), shared by the native script and the polytrain driver.

Both runners build the same HF ``LlamaForCausalLM`` from a config (seeded, nothing
downloaded), the same generated token data, AdamW (or plain SGD, ``Spec.optimizer``,
where AdamW's state would not fit: see bench.py's turns mode), and run the same step:
``model(input_ids, labels).loss``, backward, step, zero_grad. Each data-parallel
rank trains one sequence per step (TP peers share theirs). The native script times
:func:`timed_steps`; polytrain's driver times its trainer's call and then runs
:func:`timed_steps` once more inside its own workers on the model it prepared, which
tells what the launcher's processes cost apart from what polytrain's step does. Sizes:

* ``"350m"``: 24 layers, d=1024, 16 heads, MLP 2560, vocab 32000 (355.0M parameters),
  sequence 32 (short: 4 processes share 2 cores here): the memory and speed figures.
* ``"tiny"``: 2 layers, d=64, vocab 256, sequence 32: the ``--quick`` smoke run.

The held bytes of a rank are counted on its real tensors (:func:`held_bytes`):
the local shards of the parameters, their gradients and AdamW's two state
tensors, against :func:`formula_bytes`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
from typing import Any

SEED = 0
LR = 1e-4
NUM_WORKERS = 4

SIZES: dict[str, dict[str, int]] = {
    "350m": {"vocab": 32000, "hidden": 1024, "mlp": 2560, "layers": 24, "heads": 16, "seq": 32},
    "tiny": {"vocab": 256, "hidden": 64, "mlp": 128, "layers": 2, "heads": 4, "seq": 32},
}

#: The layouts measured on 4 workers, as ``parallelism=`` takes them.
LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp4": {"dp_replicate": 1, "dp_shard": 4, "tp": 1},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2, "tp": 1},
    "tp2xfsdp2": {"dp_replicate": 1, "dp_shard": 2, "tp": 2},
}


@dataclasses.dataclass
class Spec:
    """One run: the model size, the layout and how many steps (as JSON between processes)."""

    size: str = "350m"
    layout: str = "fsdp4"
    steps: int = 4
    warmup: int = 2
    optimizer: str = "adamw"

    def to_json(self) -> str:
        """The spec as a JSON string."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        """Parse :meth:`to_json`'s output."""
        return cls(**json.loads(text))

    @property
    def mesh(self) -> dict[str, int]:
        """The layout's sizes."""
        return LAYOUTS[self.layout]

    @property
    def data_parallel(self) -> int:
        """Ranks that read different data."""
        return self.mesh["dp_replicate"] * self.mesh["dp_shard"]


def build_model(size: str) -> Any:
    """The seeded Llama-style model of ``size``."""
    import torch
    import transformers

    shape = SIZES[size]
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=max(256, shape["seq"]),
    )
    return transformers.LlamaForCausalLM(config)


#: The optimizers a spec may name: AdamW (two fp32 state tensors per parameter), plain SGD (none).
OPTIMIZERS = ("adamw", "sgd")


def make_optimizer(parameters: Any, name: str) -> Any:
    """The spec's optimizer over ``parameters`` at the workload's learning rate."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=LR)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=LR)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def timed_steps(model: Any, optimizer: Any, spec: Spec, dp_rank: int, first: int) -> dict:
    """Run ``spec.steps`` plain steps from step index ``first``, between two barriers.

    The step is the one polytrain's default step runs for this workload: the model's
    own loss on this data-parallel rank's sequence, backward, ``optimizer.step()``,
    ``zero_grad()`` and the loss read back (the metric a trainer reports). Returns
    ``step_s`` (barrier to barrier, over the steps) and each step's ``step_times``.
    """
    import time

    import torch.distributed as dist

    ids = token_ids(spec.size, (first + spec.steps) * spec.data_parallel)
    step_times = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(first, first + spec.steps):
        begun = time.perf_counter()
        row = step * spec.data_parallel + dp_rank
        batch = ids[row : row + 1]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        step_times.append(time.perf_counter() - begun)
    dist.barrier()
    return {"step_s": (time.perf_counter() - start) / spec.steps, "step_times": step_times}


def num_params(size: str) -> int:
    """P: the model's parameter count (untied embedding and LM head)."""
    s = SIZES[size]
    d, m = s["hidden"], s["mlp"]
    block = 4 * d * d + 3 * d * m + 2 * d
    return 2 * s["vocab"] * d + s["layers"] * block + d


def token_ids(size: str, sequences: int) -> Any:
    """``sequences`` seeded random token sequences of the size's length."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, SIZES[size]["vocab"], (sequences, SIZES[size]["seq"]), generator=g)


def formula_bytes(size: str, layout: str, optimizer: str = "adamw") -> dict[str, float]:
    """What one rank holds by the formulas: P / (dp_shard * tp) of each fp32 tensor kind.

    AdamW keeps two state tensors per parameter, plain SGD none.

    HSDP replicates the shards over ``dp_replicate``; TP splits every matrix over
    ``tp`` (the norms, 0.01% of P, are whole on every TP rank and left out).
    """
    mesh = LAYOUTS[layout]
    share = num_params(size) / (mesh["dp_shard"] * mesh["tp"])
    states = 2 if optimizer == "adamw" else 0
    return {"params": 4 * share, "grads": 4 * share, "optimizer": 4 * states * share}


def held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """The bytes this rank holds: local shards of parameters, gradients, optimizer state."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(model.parameters())
    counted = {
        "params": sum(local(p).numel() * local(p).element_size() for p in params),
        "grads": sum(
            local(p.grad).numel() * local(p.grad).element_size()
            for p in params
            if p.grad is not None
        ),
        "optimizer": 0,
    }
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                counted["optimizer"] += local(value).numel() * local(value).element_size()
    return counted


def peak_rss_mb() -> float:
    """This process's peak resident memory (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(values: list[float]) -> float:
    """The median (the middle one of an odd count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def gib(value: float) -> float:
    """Bytes as GiB, rounded to 3 places."""
    return round(value / 2**30, 3)


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded (nan when b is 0)."""
    return round(a / b, 3) if b else math.nan
