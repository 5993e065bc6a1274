"""Small Hugging Face models and data built locally (no download) for the HF Trainer, TRL and Accelerate tests."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 32
SEQ = 8


def tiny_gpt2(seed: int = 0) -> Any:
    """A 2-layer GPT-2 built from a config, without dropout (ranks draw no random numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        pad_token_id=VOCAB - 2,
    )
    return GPT2LMHeadModel(config)


class TokenDataset(torch.utils.data.Dataset):
    """Fixed-length random token sequences (labels = inputs): every batch has the same token count."""

    def __init__(self, size: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def step_losses(log_history: list[dict[str, Any]]) -> dict[int, float]:
    """The training loss the Trainer logged at each step (``logging_steps=1``)."""
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


def word_tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w{VOCAB-3}`` plus [PAD] and [EOS], built here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 2)}
    words.update({"[PAD]": VOCAB - 2, "[EOS]": VOCAB - 1})
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[PAD]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]")


def text_dataset(size: int, words: int = SEQ - 1, seed: int = 2) -> Any:
    """``size`` texts of ``words`` random words each (one token per word, EOS appended by TRL)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (size, words), generator=generator)
    return Dataset.from_dict({"text": [" ".join(f"w{i}" for i in row.tolist()) for row in ids]})
