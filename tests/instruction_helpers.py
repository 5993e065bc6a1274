"""A generated instruction task, a tokenizer trained on it and a tiny GPT-2 (nothing downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = "red green blue cyan pink gold gray teal lime navy rust sand plum mint jade ruby".split()
OPERATIONS = ("reverse", "copy", "first", "last")
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
PROMPT = "### Instruction: {operation} {words}\n### Response:"
RESPONSE = "{answer}"
# A chat template of our own (Jinja, as a tokenizer's chat_template is).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} [EOS] {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_examples(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` instructions over 1-6 words: reverse / copy / first / last, with their answers."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
        operation = rng.choice(OPERATIONS)
        answer = {
            "reverse": words[::-1],
            "copy": words,
            "first": words[:1],
            "last": words[-1:],
        }[operation]
        examples.append(
            {"operation": operation, "words": " ".join(words), "answer": " ".join(answer)}
        )
    return examples


def build_tokenizer(path: str | Path) -> str:
    """Train a word-level tokenizer on the task's words, save it with ``save_pretrained``.

    It adds ``[BOS]`` in front of a text tokenized with special tokens, like Llama's.
    Returns the directory.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = [PROMPT.format(operation=op, words=" ".join(WORDS)) for op in OPERATIONS]
    corpus += ["<|user|> <|assistant|>"]
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    bos = tokenizer.token_to_id("[BOS]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return str(path)


def tiny_gpt2(vocab_size: int, n_positions: int = 64, seed: int = 0) -> torch.nn.Module:
    """A 2-layer GPT-2 from a config, dropout off (so runs compare exactly)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=3,
    )
    return transformers.GPT2LMHeadModel(config)
