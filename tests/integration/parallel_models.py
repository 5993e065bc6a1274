"""Tiny Llama and GPT-2 language models for the parallelism tests, and their one-process reference.

Both are HF models built from a config (no download), dropout off, with head
counts divisible by 2 (TP 2; GPT-2 is test_language_model's) and a sequence length divisible by 2 (sequence
parallelism splits it). The data are seeded arithmetic token sequences; the
gradient norm stays above the clip at every step, so a wrong clip, plan or mesh
shows in the losses, the norms and the weights.
"""

from __future__ import annotations

import math

import torch

SEQ_LEN = 16
VOCAB = 128
GLOBAL_BATCH = 8  # sequences per micro-batch over all data-parallel ranks
ACCUMULATION = 2
STEPS = 3  # optimizer steps: one epoch
NUM_SEQUENCES = STEPS * ACCUMULATION * GLOBAL_BATCH
LR = 0.5
MAX_NORM = 0.3


def llama_creator(config: dict) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=bool(config.get("tie", False)),
    )
    return transformers.LlamaForCausalLM(llama)


def gpt2_creator(config: dict) -> torch.nn.Module:
    """test_language_model's 2-layer GPT-2 (2 heads, d=32, vocab 128, dropout off)."""
    from tests.integration.test_language_model import gpt2_creator as language_model_gpt2

    return language_model_gpt2(config)


CREATORS = {"llama": llama_creator, "gpt2": gpt2_creator}


def token_ids(n: int = NUM_SEQUENCES, seed: int = 1) -> torch.Tensor:
    """Arithmetic sequences mod the vocabulary: learnable, fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ_LEN)) % VOCAB


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = NUM_SEQUENCES, seed: int = 1) -> None:
        self.ids = token_ids(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def data_creator(config: dict):
    batch = config["batch_size"]
    train = torch.utils.data.DataLoader(Tokens(), batch_size=batch)
    val = torch.utils.data.DataLoader(Tokens(GLOBAL_BATCH, seed=2), batch_size=batch)
    return train, val


def sgd_creator(model, config):
    """SGD with momentum: a per-parameter state that checkpoints must carry across layouts."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", LR), momentum=0.9)


def warmup_cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * step / STEPS)) if step else 0.5


def scheduler_creator(optimizer, config):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def reference(
    name: str, clip: bool = True, accumulate: bool = True, config: dict | None = None
) -> tuple[torch.nn.Module, list[float], list[float]]:
    """The same global batches in one process: ``(model, per-step losses, per-step norms)``.

    A ``DistributedSampler`` without shuffling gives data-parallel rank r every D-th
    sequence of the data set, so global micro-batch j is sequences ``j*B .. (j+1)*B - 1``
    whatever the number D of data-parallel ranks; the step's loss is the mean of its
    micro-batches' losses.
    """
    model = CREATORS[name](config or {})
    optimizer = sgd_creator(model, {})
    scheduler = scheduler_creator(optimizer, {})
    ids = token_ids()
    k = ACCUMULATION if accumulate else 1
    losses, norms = [], []
    for step in range(STEPS * ACCUMULATION // k):
        optimizer.zero_grad()
        total = 0.0
        for j in range(k):
            start = (step * k + j) * GLOBAL_BATCH
            chunk = ids[start : start + GLOBAL_BATCH]
            loss = model(input_ids=chunk, labels=chunk).loss
            (loss / k).backward()
            total += loss.item() / k
        limit = MAX_NORM if clip else math.inf
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        optimizer.step()
        scheduler.step()
        losses.append(total)
    return model, losses, norms
