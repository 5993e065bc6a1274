"""The GPT-2 benchmark workload (issue 26), shared by the native scripts and the polytrain driver.

Every runner builds the same ``GPT2LMHeadModel`` from a config (seeded, nothing
downloaded), the same generated token data (fixed seed), AdamW, and runs the
same step: ``model(**batch).loss``, zero_grad, backward, step, ``loss.item()``.
polytrain's default step does exactly that for mapping batches without a
``loss_creator``. Sizes:

* ``"memory"``: GPT-2 medium (24 layers, d=1024, 16 heads, vocab 50257, 354.8M
  parameters), sequence 128, one sequence per worker: the memory proof.
* ``"speed"``: 6 layers, d=512, 8 heads, vocab 50257, sequence 256, 2 sequences per
  worker: the step-time comparison.
* ``"tiny"``: 2 layers, d=64, vocab 1000, sequence 32: the ``--quick`` smoke run.

The native scripts tell this workload from the MLP one by the spec's ``model``
field ("gpt2"): :func:`benchmarks.native.task.load_task`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from benchmarks.workloads.mlp import NUM_WORKERS, SEED
from benchmarks.workloads.recorder import RECORDER

#: The model's shape per size: n_layer, n_embd, n_head, vocab_size, seq_len, per-worker batch.
SIZES: dict[str, dict[str, int]] = {
    "memory": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab": 50257, "seq": 128, "batch": 1},
    "speed": {"n_layer": 6, "n_embd": 512, "n_head": 8, "vocab": 50257, "seq": 256, "batch": 2},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 1000, "seq": 32, "batch": 2},
}
#: GPT-2's position table (as GPT-2 medium's config has it, whatever the sequence length).
N_POSITIONS = 1024
LR = 3e-4


@dataclasses.dataclass
class LMSpec:
    """What to train and for how long; travels to every process as JSON.

    Attributes:
        size: a key of :data:`SIZES` (the other fields default from it).
        steps: training steps per worker (the data set holds exactly this many global batches).
        warmup: steps left out of the steady-state statistics.
        model: always "gpt2": how the scripts tell this spec from the MLP's.
    """

    size: str = "speed"
    steps: int = 10
    warmup: int = 3
    n_layer: int = 0
    n_embd: int = 0
    n_head: int = 0
    vocab: int = 0
    seq: int = 0
    batch: int = 0
    model: str = "gpt2"

    def __post_init__(self) -> None:
        for name, value in SIZES[self.size].items():
            if not getattr(self, name):
                setattr(self, name, value)

    def to_json(self) -> str:
        """The spec as a JSON string (for a command line)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LMSpec:
        """Parse :meth:`to_json`'s output."""
        return cls(**json.loads(text))

    def num_params(self) -> int:
        """Parameter count P (tied embedding counted once), for the ZeRO formulas."""
        d = self.n_embd
        block = 12 * d * d + 13 * d  # attention 4d^2+4d, MLP 8d^2+5d, two LayerNorms 4d
        return self.vocab * d + N_POSITIONS * d + self.n_layer * block + 2 * d

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens of one global batch (every rank's sequences)."""
        return self.batch * self.seq * world_size


def gpt2_config(spec: LMSpec) -> Any:
    """The ``GPT2Config`` of ``spec`` (dropout off: the same arithmetic on every runner)."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=spec.n_layer,
        n_embd=spec.n_embd,
        n_head=spec.n_head,
        vocab_size=spec.vocab,
        n_positions=N_POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=spec.vocab - 1,  # GPT-2's 50256 with its vocabulary; inside a small one
        eos_token_id=spec.vocab - 1,
    )


def build_model(spec: LMSpec) -> Any:
    """The model, with the same initial weights in every process (seeded)."""
    import torch
    from transformers import GPT2LMHeadModel

    RECORDER.before_model()
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(gpt2_config(spec))


class TokenDataset:
    """Generated token sequences as ``{"input_ids", "labels"}`` (the model shifts the labels).

    ``spec.steps`` global batches of the benchmark's :data:`NUM_WORKERS` workers.
    """

    def __init__(self, spec: LMSpec) -> None:
        import torch

        gen = torch.Generator().manual_seed(SEED + 1)
        n = spec.steps * spec.batch * NUM_WORKERS
        self.tokens = torch.randint(0, spec.vocab, (n, spec.seq), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.tokens[index]
        return {"input_ids": row, "labels": row}


def make_loader(spec: LMSpec, rank: int, world_size: int) -> Any:
    """This rank's loader: a DistributedSampler share, ``spec.batch`` sequences per step."""
    import torch
    from torch.utils.data.distributed import DistributedSampler

    dataset = TokenDataset(spec)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=SEED)
    return torch.utils.data.DataLoader(
        dataset, batch_size=spec.batch, sampler=sampler, drop_last=True
    )


def make_optimizer(model: Any, spec: LMSpec) -> Any:
    """AdamW (two fp32 moments per parameter: what ZeRO shards)."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def loss(model: Any, batch: dict[str, Any]) -> Any:
    """The model's own loss on a mapping batch (what polytrain's default step computes)."""
    return model(**batch).loss


# ------------------------------------------------------- polytrain creators
def spec_from_config(config: dict[str, Any]) -> LMSpec:
    """The spec a trainer's ``config`` carries under ``"spec"``."""
    return LMSpec.from_json(config["spec"])


def pt_model_creator(config: dict[str, Any]) -> Any:
    """polytrain ``model_creator``."""
    return build_model(spec_from_config(config))


def pt_data_creator(config: dict[str, Any]) -> Any:
    """polytrain ``data_creator``: the full data set; polytrain adds the DistributedSampler.

    On the worker ``config["batch_size"]`` is the per-worker batch (``spec.batch``).
    """
    import torch

    return torch.utils.data.DataLoader(
        TokenDataset(spec_from_config(config)), batch_size=config["batch_size"], drop_last=True
    )


def pt_optimizer_creator(model: Any, config: dict[str, Any]) -> Any:
    """polytrain ``optimizer_creator``."""
    return make_optimizer(model, spec_from_config(config))
