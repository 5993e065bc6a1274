"""``activation_checkpointing=`` and ``compile=`` on real workers (issue 25, items 5 and 6).

The run of ``test_language_model`` (2-layer GPT-2, clipping, accumulation, a
warmup/cosine schedule, 2 workers) with activation checkpointing ends where the
one-process reference without it ends: recomputing activations changes no
weight. It is really on: every GPT-2 block's attention runs twice per
micro-batch (forward and the recomputation in backward) where it runs once
without. ``compile=True`` on ddp, fsdp2, horovod, fairscale (sddp) and DeepSpeed ZeRO-3 equals the uncompiled reference too (2 steps of
a smaller run: compiling is slow on CPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from polytrain.errors import ConfigError  # noqa: E402
from tests.integration.test_language_model import (  # noqa: E402
    ACCUMULATION,
    STEPS,
    TOLERANCE,
    WORKERS,
    make_trainer,
    max_diff,
    reference,
)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP / DeepSpeed engine -> the user's model


def count_attention_calls(operator) -> None:
    """Worker: count the forward calls of every block's attention from now on."""
    for block in _inner(operator.model).transformer.h:
        block.calls = 0

        def hook(module, args, kwargs, block=block):
            block.calls += 1

        block.attn.register_forward_pre_hook(hook, with_kwargs=True)


def attention_calls(operator) -> list[int]:
    return [block.calls for block in _inner(operator.model).transformer.h]


@pytest.fixture(scope="module")
def clipped_reference():
    return reference()


@pytest.mark.parametrize(
    ("backend", "backend_config", "checkpointing"),
    [
        pytest.param("ddp", None, True, id="ddp-hf"),
        pytest.param("ddp", None, ["GPT2Block"], id="ddp-blocks", marks=pytest.mark.long_matrix),
        pytest.param("fsdp", {"version": 2}, ["GPT2Block"], id="fsdp2-blocks"),
        pytest.param("fsdp", {"version": 2}, True, id="fsdp2-hf", marks=pytest.mark.long_matrix),
        pytest.param("deepspeed", {"stage": 3}, ["GPT2Block"], id="deepspeed3-blocks"),
    ],
)
def test_activation_checkpointing_changes_no_weight_and_recomputes(
    ray_start_4_cpus, no_leftover_actors, clipped_reference, backend, backend_config, checkpointing
):
    trainer = make_trainer(backend, backend_config, activation_checkpointing=checkpointing)
    try:
        trainer.apply_all_operators(count_attention_calls)
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        calls = trainer.apply_all_operators(attention_calls)
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    ref_model, ref_norms = clipped_reference
    # Forward and recomputation: two calls per block and micro-batch on every worker.
    assert calls == [[2 * STEPS * ACCUMULATION] * 2] * WORKERS
    assert [s["grad_norm"] for s in stats] == pytest.approx(ref_norms, rel=1e-4)
    assert max_diff(model, ref_model) < TOLERANCE


def test_without_checkpointing_a_block_runs_once(ray_start_4_cpus, no_leftover_actors):
    """The count above is the recomputation's, not the step's own."""
    trainer = make_trainer("ddp", None)
    try:
        trainer.apply_all_operators(count_attention_calls)
        trainer.train(num_steps=1)
        calls = trainer.apply_all_operators(attention_calls)
    finally:
        trainer.shutdown()
    assert calls == [[ACCUMULATION] * 2] * WORKERS


def test_a_class_name_the_model_lacks_fails_at_setup(ray_start_4_cpus, no_leftover_actors):
    with pytest.raises(ConfigError, match=r"'NoSuchBlock'.*GPT2Block"):
        make_trainer("ddp", None, activation_checkpointing=["NoSuchBlock"])


def is_compiled(operator) -> bool:
    model = operator.model  # Module.compile() sets _compiled_call_impl; DeepSpeed's engine its own
    return model._compiled_call_impl is not None or getattr(model, "is_compiled", False) is True


@pytest.mark.parametrize(
    ("backend", "backend_config"),
    [
        pytest.param("ddp", None, id="ddp"),
        pytest.param("fsdp", {"version": 2}, id="fsdp2"),
        pytest.param("horovod", None, id="horovod", marks=pytest.mark.long_matrix),
        pytest.param("fairscale", None, id="fairscale", marks=pytest.mark.long_matrix),
        pytest.param("deepspeed", {"stage": 3}, id="deepspeed3"),
    ],
)
def test_compile_equals_the_uncompiled_run(
    ray_start_4_cpus, no_leftover_actors, backend, backend_config
):
    trainer = make_trainer(backend, backend_config, compile=True)
    try:
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        compiled = trainer.apply_all_operators(is_compiled)
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    ref_model, ref_norms = reference()
    assert compiled == [True] * WORKERS
    assert [s["grad_norm"] for s in stats] == pytest.approx(ref_norms, rel=1e-4)
    assert max_diff(model, ref_model) < TOLERANCE
    assert list(model.state_dict()) == list(ref_model.state_dict())  # names unchanged
