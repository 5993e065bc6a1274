"""LoRA-fine-tune a small "pretrained" causal LM on an instruction task, on any torch backend.

Run it:  python examples/finetune_lora.py --backend fsdp --num-workers 2 --epochs 3
         polytrain train -c examples/configs/finetune_lora.yaml
         polytrain compare -c examples/configs/finetune_lora.yaml     # every torch backend

Nothing is downloaded:

1. **The "pretrained" model.** A 2-block GPT-2 over bytes (a 256-token vocabulary: no
   tokenizer) is trained briefly, in a process of its own, on the docstrings of Python's
   standard library (``examples/gpt.py``'s corpus) and written with ``save_pretrained``.
   The first run does it (about a minute on 2 CPU cores, under a file lock so that
   workers starting together wait for it); later runs reuse it.
2. **Instruction data.** Generated pairs ``"Q: upper <word>\\nA: <WORD>\\n"``: the prompt's
   tokens get the label -100 (masked out of the loss), the answer's are trained; the
   rows are padded with -100 labels. The loss the trainer reports is the answer loss.
3. **LoRA.** ``model_creator`` is ``polytrain.hf.from_pretrained(base)`` (on the workers
   each rank reads only its part of the weights) and ``peft_config=`` adds LoRA
   adapters (r=8) to the attention and MLP projections: only they train; checkpoints
   hold only them.
4. **Out.** ``trainer.save_pretrained(adapter_dir)`` writes the adapter in PEFT's layout;
   it is loaded back with ``peft.PeftModel.from_pretrained(base, adapter_dir)``, which
   gives the trained model's answer loss, and answers a few prompts greedily.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

SEED = 0
VOCAB = 256
PAD = 0
LORA = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["c_attn", "c_proj", "c_fc"],
}
#: The base model's shape and its pretraining (part of its directory's name: a change rebuilds it).
BASE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64, "steps": 150, "lr": 3e-3}


# ------------------------------------------------------------------ the base model
def default_base_dir() -> str:
    """Where the base is kept: the same path for every process on this machine."""
    tag = "-".join(f"{k}{v}" for k, v in BASE.items())
    return os.path.join(tempfile.gettempdir(), "polytrain-finetune-lora", f"base-{tag}")


def ensure_base(base_dir: str) -> str:
    """The base model's directory, pretrained first if it is not there (once, under a lock).

    The pretraining runs in a process of its own: a ``model_creator`` may run under
    the meta device or DeepSpeed's ``zero.Init``, where no model can be trained.
    """
    done = Path(base_dir) / "config.json"
    if done.exists():
        return base_dir
    Path(base_dir).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{base_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process that waited finds it done
        if not done.exists():
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            command = [sys.executable, os.path.abspath(__file__), "--pretrain-only", base_dir]
            subprocess.run(command, check=True, cwd=root, env={**os.environ, "PYTHONPATH": path})
    return base_dir


def pretrain(base_dir: str) -> None:
    """Train the byte-level GPT-2 briefly on text and save it (this process, one CPU thread)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from examples.gpt import ByteSequences, corpus_bytes

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=BASE["seq_len"], n_layer=BASE["n_layer"],
        n_embd=BASE["n_embd"], n_head=BASE["n_head"], bos_token_id=PAD, eos_token_id=PAD,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE["lr"])
    data = ByteSequences(corpus_bytes(), BASE["seq_len"])
    loader = DataLoader(
        data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model.train()
    for step, batch in zip(range(BASE["steps"]), _forever(loader), strict=False):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == BASE["steps"] - 1:
            print(f"pretraining step {step}: loss {loss.item():.3f}", flush=True)
    tmp = f"{base_dir}.partial-{os.getpid()}"
    model.save_pretrained(tmp)
    os.rename(tmp, base_dir)  # complete or absent


def _forever(loader: DataLoader):
    while True:
        yield from loader


# ------------------------------------------------------------------ instruction data
def instruction(rng: torch.Generator) -> tuple[str, str]:
    """One generated task: a prompt and its answer."""
    length = int(torch.randint(3, 7, (1,), generator=rng))
    word = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 26, (length,), generator=rng))
    return f"Q: upper {word}\nA: ", f"{word.upper()}\n"


class InstructionSet(Dataset):
    """Tokenised (bytes) prompt + answer rows, padded to ``seq_len``; prompt and padding labelled -100."""

    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        self.rows = [self._row(*instruction(rng), seq_len) for _ in range(n)]

    @staticmethod
    def _row(prompt: str, answer: str, seq_len: int) -> dict[str, torch.Tensor]:
        p, a = list(prompt.encode()), list(answer.encode())
        ids = (p + a + [PAD] * seq_len)[:seq_len]
        labels = ([-100] * len(p) + a + [-100] * seq_len)[:seq_len]
        mask = [1] * min(len(p) + len(a), seq_len) + [0] * max(seq_len - len(p) - len(a), 0)
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(labels),
        }

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


# ------------------------------------------------------------------ creators
def model_creator(config: dict) -> torch.nn.Module:
    """The pretrained base (pretrained first, once); ``peft_config=`` adds the adapters."""
    from polytrain.hf import from_pretrained

    base = ensure_base(config.get("base_dir") or default_base_dir())
    torch.manual_seed(config.get("seed", SEED))  # the adapters' initialisation follows
    return from_pretrained(base)


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    """Generated instructions: training and validation (another seed)."""
    seq_len, batch = config.get("seq_len", 32), config["batch_size"]
    train = InstructionSet(config.get("num_examples", 512), seq_len, seed=1)
    val = InstructionSet(config.get("num_val", 64), seq_len, seed=2)
    generator = torch.Generator().manual_seed(config.get("seed", SEED))
    return (
        DataLoader(train, batch_size=batch, shuffle=True, generator=generator),
        DataLoader(val, batch_size=batch),
    )


def optimizer_creator(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """AdamW over the model (polytrain keeps only the trainable adapters in it)."""
    return torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))


# ------------------------------------------------------------------ after training
def answer_loss(model: torch.nn.Module, config: dict) -> float:
    """The mean answer loss of ``model`` on the validation instructions, in this process."""
    _, val = data_creator({**config, "batch_size": 16})
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in val:
            total += model(**batch).loss.item() * len(batch["input_ids"])
            count += len(batch["input_ids"])
    return total / count


def answer(model: torch.nn.Module, prompt: str, max_new: int = 8) -> str:
    """Greedy decoding of ``prompt``'s answer, up to the end of its line."""
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        for _ in range(max_new):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            if int(next_id) == ord("\n"):
                break
    return bytes(ids[0, len(prompt.encode()) :].tolist()).decode(errors="replace").strip()


def main() -> None:
    """Pretrain (once), LoRA-fine-tune, export and reload the adapter."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--out", default="runs/finetune_lora", help="the adapter goes here")
    parser.add_argument(
        "--base-dir", default=None, help="the pretrained base (default: a temp dir)"
    )
    parser.add_argument("--pretrain-only", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pretrain_only:
        pretrain(args.pretrain_only)
        return
    import peft
    from transformers import AutoModelForCausalLM

    from polytrain import TorchTrainer

    base = ensure_base(args.base_dir or default_base_dir())
    config = {"batch_size": args.batch_size, "base_dir": base, "lr": 3e-3}
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        config=config,
        num_workers=args.num_workers,
        backend=args.backend,
        peft_config=LORA,
        max_grad_norm=1.0,
    )
    adapter = os.path.join(args.out, f"adapter-{args.backend}")
    try:
        before = trainer.validate()["val_loss"]
        print(f"answer loss before fine-tuning: {before:.3f}")
        for _ in range(args.epochs):
            stats, val = trainer.train(), trainer.validate()
            print(
                f"epoch {stats['epoch']}: train {stats['loss']:.3f}  answer loss {val['val_loss']:.3f}"
            )
        if os.path.exists(adapter):
            import shutil

            shutil.rmtree(adapter)
        trainer.save_pretrained(adapter)
        trained = trainer.get_model()
    finally:
        trainer.shutdown()
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    print(
        f"adapter reloaded with peft from {adapter}: answer loss {answer_loss(reloaded, config):.4f}"
        f" (the trained model's: {answer_loss(trained, config):.4f})"
    )
    for word in ("cat", "model", "rank"):
        print(f"  upper {word} -> {answer(reloaded, f'Q: upper {word}' + chr(10) + 'A: ')!r}")
    if not math.isfinite(before):
        raise SystemExit("the answer loss is not finite")


if __name__ == "__main__":
    main()
