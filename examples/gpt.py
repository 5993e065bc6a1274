"""Train a small GPT-2-style causal language model on any torch backend (no download).

Run it:  python examples/gpt.py --backend fsdp --num-workers 2 --epochs 2 --max-grad-norm 1.0

The text is the docstrings of Python's standard library modules (shipped with
Python), tokenised byte by byte (a 256-token vocabulary: no tokenizer to
download), cut into fixed-length sequences; the model is HF transformers'
``GPT2LMHeadModel`` built from a config. Batches are dicts
(``input_ids``, ``attention_mask``, ``labels``) and the model computes its own
loss, so there is no ``loss_creator``. The YAML configs ``examples/configs/gpt.yaml``
and ``gpt_fsdp.yaml`` point at these creators; ``polytrain compare -c
examples/configs/gpt.yaml`` runs the job on every torch backend.
"""

from __future__ import annotations

import argparse
import importlib
import math

import torch
from torch.utils.data import DataLoader, Dataset

SEED = 0
VOCAB = 256  # bytes
#: Standard-library modules whose docstrings are the corpus (fixed: the data is reproducible).
TEXT_MODULES = (
    "argparse", "collections", "json", "pathlib", "functools", "itertools", "textwrap",
    "dataclasses", "typing", "inspect", "logging", "csv", "email", "http.client", "unittest",
)  # fmt: skip


def corpus_bytes(modules: tuple[str, ...] = TEXT_MODULES) -> bytes:
    """The docstrings of ``modules`` and of their public functions and classes, as UTF-8."""
    parts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(module.__doc__ or "")
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            # Only what the module defines: its namespace also holds submodules that
            # other imports happened to load, which would make the corpus vary.
            if not attr.startswith("_") and getattr(obj, "__module__", None) == name:
                parts.append(obj.__doc__ if isinstance(obj.__doc__, str) else "")
    return "\n\n".join(p.strip() for p in parts if p.strip()).encode("utf-8")


class ByteSequences(Dataset):
    """Consecutive ``seq_len``-byte windows of the corpus as causal-LM examples."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n = len(ids) // seq_len
        self.ids = ids[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def model_creator(config: dict) -> torch.nn.Module:
    """A GPT-2 of ``n_layer`` blocks of width ``n_embd`` over the byte vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(config.get("seed", SEED))
    gpt2 = GPT2Config(
        vocab_size=VOCAB,
        n_positions=config.get("seq_len", 64),
        n_layer=config.get("n_layer", 2),
        n_embd=config.get("n_embd", 64),
        n_head=config.get("n_head", 4),
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(gpt2)


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """Train / validation loaders (the last tenth of the corpus validates).

    ``config["num_sequences"]`` caps the training sequences (a quick run); the
    order is shuffled with a fixed seed.
    """
    seq_len = config.get("seq_len", 64)
    data = corpus_bytes()
    split = int(len(data) * 0.9)
    train, val = ByteSequences(data[:split], seq_len), ByteSequences(data[split:], seq_len)
    if config.get("num_sequences"):
        train.ids = train.ids[: config["num_sequences"]]
        val.ids = val.ids[: max(config["num_sequences"] // 4, 1)]
    generator = torch.Generator().manual_seed(config.get("seed", SEED))
    batch = config["batch_size"]
    return (
        DataLoader(train, batch_size=batch, shuffle=True, generator=generator),
        DataLoader(val, batch_size=batch),
    )


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """AdamW, as language models are trained."""
    return torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3), weight_decay=0.01)


def scheduler_creator(optimizer: torch.optim.Optimizer, config: dict):
    """Linear warmup then cosine decay, stepped per optimizer step."""
    warmup, total = config.get("warmup_steps", 10), config.get("total_steps", 200)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total - warmup, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main() -> None:
    """Train and validate from the command line."""
    from polytrain import TorchTrainer, available_backends

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddp", help=f"one of {available_backends('torch')}")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=None, help="optimizer steps per epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="global micro-batch")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--num-sequences", type=int, default=0, help="cap the data (0: all)")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()

    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        scheduler_creator=scheduler_creator,
        config={"batch_size": args.batch_size, "num_sequences": args.num_sequences},
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        backend=args.backend,
        max_grad_norm=args.max_grad_norm,
        gradient_accumulation_steps=args.grad_accum,
        precision=args.precision,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
    )
    try:
        for _ in range(args.epochs):
            stats = trainer.train(num_steps=args.num_steps)
            val = trainer.validate()
            print(
                f"epoch {stats['epoch']}: loss {stats['loss']:.4f}  grad_norm "
                f"{stats.get('grad_norm', math.nan):.3f}  val_loss {val['val_loss']:.4f}  "
                f"val_perplexity {val['val_perplexity']:.2f}  {stats['tokens_per_s']:.0f} tokens/s"
            )
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
