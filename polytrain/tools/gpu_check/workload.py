"""The GPU check's workload: a GPT-2 built from a config, generated tokens, FLOPs and peaks.

Both sides of every comparison build the same model with the same seed, read the
same batches in the same order and take the same step (``model(**batch).loss``,
``zero_grad``, backward, optimizer step, ``loss.item()``): polytrain's default step
for a mapping batch without a ``loss_creator``, and :func:`plain_steps`, the plain
single-device loop a user would write. Nothing is downloaded.

The tokens follow a fixed cycle through a permutation of 2048 token ids (each
sequence starts at a random place in it): the next token is a function of the
current one. The check steps all train on the same batch, so the loss falls clearly
and steadily over them (the model fits that batch: by 7 % over 3 updates on the tiny
model). On fresh random tokens it could not (their best loss is ln(vocab), where an
untrained GPT-2 starts), and a step that updates nothing would pass for one that
trains; the steps after the check steps read fresh batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

#: Seeds of the weights and of the data.
SEED = 1234
DATA_SEED = 4321
#: Distinct token ids the data cycles through.
CYCLE = 2048
LR = 1e-3
#: The timed steps run as this many chunks, each timed apart; tokens/s comes from the
#: median chunk (one slow chunk, a clock change or a hiccup, does not move it).
TIMED_CHUNKS = 3

#: Model shapes: GPT-2 small (124M, the check on a GPU) and a tiny one (the CPU run).
SIZES: dict[str, dict[str, int]] = {
    "gpt2-124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 4096, "seq": 64},
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained, and how many steps of each kind.

    Attributes:
        size: a key of :data:`SIZES`.
        batch: sequences per step.
        check_steps: steps whose losses are compared with the plain loop.
        warmup_steps: steps after those, before the timed ones (compiled graphs warm).
        timed_steps: steps timed for tokens/s and MFU.
        seq: tokens per sequence instead of the size's (0: the size's).
    """

    size: str = "gpt2-124m"
    batch: int = 16
    check_steps: int = 4
    warmup_steps: int = 2
    timed_steps: int = 21
    seq: int = 0

    @property
    def shape(self) -> dict[str, int]:
        """The model's shape (:data:`SIZES`; ``seq``, when set, replaces its sequence length)."""
        return {**SIZES[self.size], **({"seq": self.seq} if self.seq else {})}

    @property
    def steps(self) -> int:
        """All steps of one case: the data set holds exactly this many batches."""
        return self.check_steps + self.warmup_steps + self.timed_steps

    def chunk_sizes(self) -> list[int]:
        """The timed steps in :data:`TIMED_CHUNKS` chunks, timed apart (their median counts)."""
        count = min(TIMED_CHUNKS, self.timed_steps)
        return [self.timed_steps // count + (i < self.timed_steps % count) for i in range(count)]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step's batch."""
        return self.batch * self.shape["seq"]


def gpt2_config(workload: Workload) -> Any:
    """The ``GPT2Config``: dropout off (both sides do the same arithmetic), SDPA attention."""
    from transformers import GPT2Config

    shape = workload.shape
    return GPT2Config(
        n_layer=shape["n_layer"],
        n_embd=shape["n_embd"],
        n_head=shape["n_head"],
        vocab_size=shape["vocab"],
        n_positions=max(1024, shape["seq"]),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=shape["vocab"] - 1,
        eos_token_id=shape["vocab"] - 1,
        attn_implementation="sdpa",
    )


def build_model(workload: Workload) -> Any:
    """The model, with the same initial weights wherever it is built (seeded)."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(gpt2_config(workload))


class TokenData:
    """``workload.steps`` batches of ``{"input_ids", "labels"}`` (the model shifts the labels).

    The first ``check_steps`` batches are one batch repeated.
    """

    def __init__(self, workload: Workload) -> None:
        import torch

        gen = torch.Generator().manual_seed(DATA_SEED)
        vocab, seq = workload.shape["vocab"], workload.shape["seq"]
        cycle = torch.randperm(vocab, generator=gen)[: min(CYCLE, vocab)]
        count = workload.steps * workload.batch
        starts = torch.randint(0, len(cycle), (count, 1), generator=gen)
        self.tokens = cycle[(starts + torch.arange(seq)) % len(cycle)]
        first = self.tokens[: workload.batch].clone()
        for step in range(1, workload.check_steps):  # the check steps fit one batch
            self.tokens[step * workload.batch : (step + 1) * workload.batch] = first

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.tokens[index]
        return {"input_ids": row, "labels": row}


def make_loader(workload: Workload, batch_size: int | None = None) -> Any:
    """The batches in order (no shuffle): polytrain's sampler keeps that order at one rank."""
    import torch

    return torch.utils.data.DataLoader(
        TokenData(workload),
        batch_size=batch_size or workload.batch,
        shuffle=False,
        drop_last=True,
    )


def make_optimizer(model: Any) -> Any:
    """AdamW (fused kernels where torch picks them; the same on both sides)."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def count_params(model: Any) -> int:
    """Parameters that take part in matrix products: all but the position table.

    GPT-2 ties ``lm_head`` to the token embedding: counted once, as the output
    projection it is (the embedding lookup itself is not a matrix product).
    """
    wpe = model.transformer.wpe.weight.numel()
    return sum(p.numel() for p in model.parameters()) - wpe


def flops_per_token(workload: Workload, matmul_params: int) -> float:
    """Training FLOPs of one token: ``6 N + 12 L d T`` (PaLM's appendix B, nanoGPT's MFU).

    ``6 N``: forward and backward through the weights; ``12 L d T``: attention's
    scores and weighted values over a context of T tokens. Recomputation under
    activation checkpointing is not counted (MFU counts the model's FLOPs, as
    torchtitan's figures do).
    """
    shape = workload.shape
    return 6.0 * matmul_params + 12.0 * shape["n_layer"] * shape["n_embd"] * shape["seq"]


#: Dense bf16 / fp16 tensor-core peaks (TFLOP/s, no sparsity) by device-name fragment,
#: most specific first. Data-sheet values.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835.0),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s from :data:`PEAK_TFLOPS`, or None (unknown, or a CPU)."""
    for fragment, value in PEAK_TFLOPS:
        if fragment in device_name:
            return value
    return None


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (None without a peak)."""
    if not peak:
        return None
    return tokens_per_s * flops_token / (peak * 1e12)


# ------------------------------------------------------------------- the plain loop
def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """The plain loop's forward context: autocast to bf16 / fp16, or nothing for fp32.

    On a CPU ``"fp16"`` is bf16, as polytrain runs it there (fp16 CPU kernels are
    slow or missing).
    """
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" and device == "cuda" else torch.bfloat16
    return torch.autocast(device, dtype=dtype)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (timing boundaries)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def plain_steps(
    workload: Workload, device: str, precision: str, checkpointing: bool, compile: bool
) -> dict[str, Any]:
    """The plain single-device loop: what polytrain's numbers are compared against.

    Returns:
        ``losses`` (the check steps), ``step_s`` and ``chunk_step_s`` (:func:`timing`),
        ``setup_s`` (model, optimizer, compile wrapper) and ``first_step_s``.
    """
    import torch

    start = time.perf_counter()
    model = build_model(workload).to(device)
    if checkpointing:  # what polytrain's activation_checkpointing=True does for an HF model
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device == "cuda" else None
    if compile:
        model.compile()
    model.train()
    setup_s = time.perf_counter() - start
    losses: list[float] = []
    first_step_s = 0.0
    batches = iter(make_loader(workload))

    def step() -> float:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        optimizer.zero_grad()
        with autocast(device, precision):
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.item()

    for index in range(workload.check_steps):
        began = time.perf_counter()
        losses.append(step())
        if index == 0:
            first_step_s = time.perf_counter() - began
    for _ in range(workload.warmup_steps):
        step()
    chunks = []
    for size in workload.chunk_sizes():
        synchronize(device)
        began = time.perf_counter()
        for _ in range(size):
            step()
        synchronize(device)
        chunks.append((time.perf_counter() - began) / size)
    return {"losses": losses, **timing(chunks), "setup_s": setup_s, "first_step_s": first_step_s}


def timing(chunks: list[float]) -> dict[str, Any]:
    """``step_s``: the median of the chunks' mean step times; ``chunk_step_s``: each of them."""
    ordered = sorted(chunks)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"step_s": median, "chunk_step_s": chunks}


def relative_differences(losses: list[float], reference: list[float]) -> list[float]:
    """``|a - b| / |b|`` per step (inf where a loss is not finite)."""
    out = []
    for a, b in zip(losses, reference, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            out.append(math.inf)
        else:
            out.append(abs(a - b) / max(abs(b), 1e-12))
    return out
