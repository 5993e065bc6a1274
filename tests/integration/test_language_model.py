"""The language-model step on every torch backend, proved equal to one process (issue 25).

A 2-layer GPT-2 (HF ``GPT2LMHeadModel`` from a config, dropout off) trains on
synthetic token sequences with ``max_grad_norm``, ``gradient_accumulation_steps=2``
and a per-step warmup + cosine ``LambdaLR``, on 2 workers. The reference runs
the same global batches in this process (no Ray) with plain accumulation and
``torch.nn.utils.clip_grad_norm_``. The clip is active at every step (the norms
are above ``MAX_NORM``), and the reference without clipping, or without
accumulation, ends far outside the tolerance: a backend that clips unreduced or
sharded gradients, skips the clip, or steps every micro-batch fails.

``ddp`` and ``fsdp`` (v2) are the fast pair and run first
(``-k "ddp or fsdp2"``); the others follow.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from polytrain import TorchTrainer  # noqa: E402

SEQ_LEN = 16
VOCAB = 128
PER_WORKER_BATCH = 4
WORKERS = 2
ACCUMULATION = 2
STEPS = 3  # optimizer steps: the whole epoch
NUM_SEQUENCES = STEPS * ACCUMULATION * PER_WORKER_BATCH * WORKERS
LR = 0.5
MAX_NORM = 0.3
WARMUP = 1
TOLERANCE = 2e-5


def gpt2_creator(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(gpt2)


class TokenSequences(torch.utils.data.Dataset):
    """Arithmetic sequences mod the vocabulary: learnable, fixed by the seed."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def data_creator(config: dict):
    batch = config["batch_size"]
    train = torch.utils.data.DataLoader(TokenSequences(NUM_SEQUENCES), batch_size=batch)
    val = torch.utils.data.DataLoader(TokenSequences(8 * WORKERS, seed=2), batch_size=batch)
    return train, val


def sgd_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", LR))


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / (WARMUP + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(STEPS - WARMUP, 1)))


def scheduler_creator(optimizer, config):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def reference(clip: bool = True, accumulate: bool = True) -> tuple[torch.nn.Module, list[float]]:
    """The same global batches in this process: plain accumulation and ``clip_grad_norm_``.

    The global micro-batch ``j`` of a ``DistributedSampler`` without shuffling is
    sequences ``j * W * b ... (j + 1) * W * b - 1``: rank r takes every W-th one.
    ``accumulate=False`` steps after every micro-batch instead (what dropping the
    accumulation would do).
    """
    model = gpt2_creator({})
    optimizer = sgd_creator(model, {})
    scheduler = scheduler_creator(optimizer, {})
    ids = TokenSequences(NUM_SEQUENCES).ids
    micro = PER_WORKER_BATCH * WORKERS
    k = ACCUMULATION if accumulate else 1
    norms = []
    for step in range(STEPS * ACCUMULATION // k):
        optimizer.zero_grad()
        for j in range(k):
            start = (step * k + j) * micro
            chunk = ids[start : start + micro]
            loss = model(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk).loss
            (loss / k).backward()
        limit = MAX_NORM if clip else math.inf
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        optimizer.step()
        scheduler.step()
    return model, norms


@pytest.fixture(scope="module")
def references():
    return {
        "clipped": reference(),
        "unclipped": reference(clip=False),
        "unaccumulated": reference(accumulate=False),
    }


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def test_the_reference_is_sensitive_to_clipping_and_accumulation(references):
    """Without this, equality below would not prove the clip and the accumulation."""
    model, norms = references["clipped"]
    assert min(norms) > MAX_NORM  # the clip acts at every step
    assert max_diff(model, references["unclipped"][0]) > 100 * TOLERANCE
    assert max_diff(model, references["unaccumulated"][0]) > 100 * TOLERANCE


BACKENDS = [
    pytest.param("ddp", None, id="ddp"),
    pytest.param("fsdp", {"version": 2}, id="fsdp2"),
    pytest.param("fsdp", {"version": 1}, id="fsdp1"),
    pytest.param("horovod", None, id="horovod"),
    pytest.param("fairscale", None, id="fairscale"),
    pytest.param("deepspeed", {"stage": 1}, id="deepspeed1"),
    pytest.param("deepspeed", {"stage": 2}, id="deepspeed2"),
    pytest.param("deepspeed", {"stage": 3}, id="deepspeed3"),
]


def make_trainer(backend, backend_config, num_workers=WORKERS, **kwargs) -> TorchTrainer:
    """2 workers, clipping, accumulation and the per-step schedule of :func:`reference`.

    ``num_workers=0``: one process (local mode) on the reference's global micro-batches;
    ``kwargs`` may replace ``max_grad_norm`` and ``gradient_accumulation_steps``.
    """
    options = {"max_grad_norm": MAX_NORM, "gradient_accumulation_steps": ACCUMULATION, **kwargs}
    return TorchTrainer(
        model_creator=gpt2_creator,
        data_creator=data_creator,
        optimizer_creator=sgd_creator,
        scheduler_creator=scheduler_creator,
        config={"batch_size": PER_WORKER_BATCH * WORKERS},
        num_workers=num_workers,
        backend=backend,
        backend_config=backend_config,
        failure_config={"max_retries": 0},
        **options,
    )


@pytest.mark.parametrize(("backend", "backend_config"), BACKENDS)
def test_clipped_accumulated_steps_equal_one_process(
    ray_start_4_cpus, no_leftover_actors, references, backend, backend_config
):
    trainer = make_trainer(backend, backend_config)
    try:
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        model = trainer.get_model()
        val = trainer.validate()
    finally:
        trainer.shutdown()
    ref_model, ref_norms = references["clipped"]
    assert [s["num_steps"] for s in stats] == [1] * STEPS  # optimizer steps, not batches
    assert stats[-1]["epoch"] == 0 and trainer.epoch == 1  # 3 steps of 2 batches: the epoch
    assert [s["grad_norm"] for s in stats] == pytest.approx(ref_norms, rel=1e-4)
    assert max_diff(model, ref_model) < TOLERANCE
    assert stats[0]["num_samples"] == ACCUMULATION * PER_WORKER_BATCH * WORKERS
    assert stats[0]["num_tokens"] == stats[0]["num_samples"] * SEQ_LEN
    assert stats[0]["tokens_per_s"] > 0
    assert val["val_perplexity"] == pytest.approx(math.exp(val["val_loss"]))


def adamw_creator(model, config):
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


@pytest.mark.parametrize(
    ("backend", "backend_config"),
    [
        pytest.param("ddp", None, id="ddp"),
        pytest.param("fsdp", {"version": 2}, id="fsdp2"),
        pytest.param("deepspeed", {"stage": 2}, id="deepspeed2"),
    ],
)
def test_bf16_trains(ray_start_4_cpus, no_leftover_actors, backend, backend_config):
    """bf16 autocast (FSDP2: its MixedPrecisionPolicy; DeepSpeed: its autocast) learns."""
    trainer = TorchTrainer(
        model_creator=gpt2_creator,
        data_creator=data_creator,
        optimizer_creator=adamw_creator,
        config={"batch_size": PER_WORKER_BATCH * WORKERS},
        num_workers=WORKERS,
        backend=backend,
        backend_config=backend_config,
        precision="bf16",
        max_grad_norm=1.0,
        failure_config={"max_retries": 0},
    )
    try:
        before = trainer.validate()["val_loss"]
        for _ in range(4):
            trainer.train()
        after = trainer.validate()["val_loss"]
    finally:
        trainer.shutdown()
    assert after < before - 0.3, (before, after)


def remainder_reference(total_micro: int) -> torch.nn.Module:
    """Steps of 2 micro-batches and a last one of 1, its loss not halved."""
    model = gpt2_creator({})
    optimizer = sgd_creator(model, {})
    ids = TokenSequences(total_micro * PER_WORKER_BATCH * WORKERS).ids
    micro = PER_WORKER_BATCH * WORKERS
    chunks = [ids[i * micro : (i + 1) * micro] for i in range(total_micro)]
    for start in range(0, total_micro, ACCUMULATION):
        group = chunks[start : start + ACCUMULATION]
        optimizer.zero_grad()
        for chunk in group:
            loss = model(input_ids=chunk, labels=chunk).loss
            (loss / len(group)).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_an_epoch_remainder_gets_its_own_step(ray_start_4_cpus, no_leftover_actors, backend):
    """5 batches per worker and k=2: an epoch of steps over 2, 2 and 1 batches."""
    total_micro = 5

    def five_batches(config):
        data = TokenSequences(total_micro * PER_WORKER_BATCH * WORKERS)
        return torch.utils.data.DataLoader(data, batch_size=config["batch_size"])

    trainer = TorchTrainer(
        model_creator=gpt2_creator,
        data_creator=five_batches,
        optimizer_creator=sgd_creator,
        config={"batch_size": PER_WORKER_BATCH * WORKERS},
        num_workers=WORKERS,
        backend=backend,
        gradient_accumulation_steps=ACCUMULATION,
        failure_config={"max_retries": 0},
    )
    try:
        first = trainer.train()
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert first["num_steps"] == 3 and first["num_samples"] == total_micro * 8
    assert max_diff(model, remainder_reference(total_micro)) < TOLERANCE
