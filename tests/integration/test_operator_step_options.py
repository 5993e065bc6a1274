"""The trainer's step options hold for a custom ``train_batch`` / ``train_epoch`` (issue 39, item 1).

A RaySGD-style operator (``self.zero_grad(); self.backward(loss); self.step()``) on
the 2-layer GPT-2 of ``test_language_model`` with ``max_grad_norm`` and
``gradient_accumulation_steps=2`` ends where the one-process reference with clipping
and accumulation ends, and reports the same ``grad_norm``s, on every torch backend
with 2 workers (ddp and horovod in every run; the others with ``make test-long``).
Before, such an operator trained unclipped and unaccumulated without a word.

In local mode (one process, the reference's global batches, no Ray): ``precision``
autocasts a custom step, an own ``train_epoch`` is clipped, an explicit
``self.clip_grad_norm_`` is not clipped again by ``self.step()``, two optimizers
stepped one by one are clipped one by one, and a step that goes around the helpers
where an option lives there is refused, naming the option and the fix.
``activation_checkpointing`` and ``compile`` are applied to the model before the
operator exists: a custom step gets them too (2 workers).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from polytrain import TorchTrainer, TrainingOperator  # noqa: E402
from polytrain.trainer_api.torch.step_record import StepOptionError  # noqa: E402
from tests.integration.test_language_model import (  # noqa: E402
    ACCUMULATION,
    STEPS,
    TOLERANCE,
    WORKERS,
    make_trainer,
    max_diff,
)
from tests.integration.test_language_model import references as lm_references  # noqa: E402
from tests.integration.test_lm_checkpointing_compile import (  # noqa: E402
    attention_calls,
    count_attention_calls,
    is_compiled,
)


def _num_samples(batch) -> int:
    return int(batch["input_ids"].shape[0])


class RaySGDStyle(TrainingOperator):
    """The step RaySGD's users wrote, on polytrain's helpers: no clip, no autocast of its own."""

    def train_batch(self, batch, batch_info):
        self.zero_grad()
        output = self.model(**batch)
        self.backward(output.loss)
        self.step()
        self.logits_dtype = output.logits.dtype
        return {"loss": output.loss.item(), "num_samples": _num_samples(batch)}


#: The one-process references (clipped, unclipped, unaccumulated) as a fixture of this module.
references = lm_references

BACKENDS = [
    pytest.param("ddp", None, id="ddp"),
    pytest.param("horovod", None, id="horovod"),
    pytest.param("fairscale", None, id="fairscale", marks=pytest.mark.long_matrix),
    pytest.param("fsdp", {"version": 2}, id="fsdp2", marks=pytest.mark.long_matrix),
    pytest.param("fsdp", {"version": 1}, id="fsdp1", marks=pytest.mark.long_matrix),
    pytest.param("deepspeed", {"stage": 2}, id="deepspeed2", marks=pytest.mark.long_matrix),
]


@pytest.mark.parametrize(("backend", "backend_config"), BACKENDS)
def test_a_raysgd_style_step_is_clipped_and_accumulated_as_one_process(
    ray_start_4_cpus, no_leftover_actors, references, backend, backend_config
):
    trainer = make_trainer(backend, backend_config, training_operator_cls=RaySGDStyle)
    try:
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    ref_model, ref_norms = references["clipped"]
    assert [s["num_steps"] for s in stats] == [1] * STEPS
    assert [s["grad_norm"] for s in stats] == pytest.approx(ref_norms, rel=1e-4)
    assert max_diff(model, ref_model) < TOLERANCE
    # What the same operator trained to before: neither clipped nor accumulated.
    assert max_diff(model, references["unclipped"][0]) > 100 * TOLERANCE
    assert max_diff(model, references["unaccumulated"][0]) > 100 * TOLERANCE


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"activation_checkpointing": True}, id="checkpointing"),
        pytest.param({"compile": True}, id="compile", marks=pytest.mark.long_matrix),
    ],
)
def test_set_up_options_hold_for_a_custom_step(
    ray_start_4_cpus, no_leftover_actors, references, options
):
    """Applied to the model before the operator exists: a custom step runs the same model."""
    trainer = make_trainer("ddp", None, training_operator_cls=RaySGDStyle, **options)
    try:
        trainer.apply_all_operators(count_attention_calls)
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        calls = trainer.apply_all_operators(attention_calls)
        compiled = trainer.apply_all_operators(is_compiled)
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    if options.get("activation_checkpointing"):  # forward and recomputation: twice a batch
        assert calls == [[2 * STEPS * ACCUMULATION] * 2] * WORKERS
    if options.get("compile"):
        assert compiled == [True] * WORKERS
    ref_model, ref_norms = references["clipped"]
    assert [s["grad_norm"] for s in stats] == pytest.approx(ref_norms, rel=1e-4)
    assert max_diff(model, ref_model) < TOLERANCE


# ------------------------------------------------------------------ local mode
def local_trainer(operator=None, **options) -> TorchTrainer:
    """One process, the reference's global micro-batches (no sampler, no Ray)."""
    return make_trainer("ddp", None, num_workers=0, training_operator_cls=operator, **options)


def train_epoch_of(trainer: TorchTrainer) -> tuple[torch.nn.Module, dict]:
    try:
        stats = trainer.train()
        return trainer.get_model(), stats
    finally:
        trainer.shutdown()


def test_a_custom_step_runs_under_the_precision_autocast():
    """bf16: the custom step's forward is bf16 and ends where the default step's ends."""
    trainer = local_trainer(RaySGDStyle, precision="bf16")
    try:
        trainer.train()
        dtype = trainer.apply_all_operators(lambda operator: operator.logits_dtype)
        custom = trainer.get_model()
    finally:
        trainer.shutdown()
    default, _ = train_epoch_of(local_trainer(precision="bf16"))
    assert dtype == [torch.bfloat16]  # fp32 before: the forward ran outside any autocast
    assert max_diff(custom, default) == 0.0  # bit for bit (its backward under autocast too)


class OwnEpoch(TrainingOperator):
    """RaySGD's own ``train_epoch``: its loop, the helpers for each batch."""

    def train_epoch(self, iterator, info):
        losses = []
        for batch in iterator:
            self.zero_grad()
            loss = self.model(**batch).loss
            self.backward(loss)
            self.step()
            self.scheduler.step()
            losses.append(loss.item())
        return {"loss": sum(losses) / len(losses), "num_steps": len(losses)}


def test_an_own_train_epoch_is_clipped(references):
    model, stats = train_epoch_of(local_trainer(OwnEpoch, gradient_accumulation_steps=1))
    ref_model, ref_norms = references["unaccumulated"]
    assert max_diff(model, ref_model) < TOLERANCE
    assert stats["grad_norm"] == pytest.approx(sum(ref_norms) / len(ref_norms), rel=1e-4)


class ClipsItself(RaySGDStyle):
    """Clips (here to a norm no gradient reaches) before ``self.step()``."""

    def train_batch(self, batch, batch_info):
        self.zero_grad()
        loss = self.model(**batch).loss
        self.backward(loss)
        self.clip_grad_norm_(1e9)
        self.step()
        return {"loss": loss.item(), "num_samples": _num_samples(batch)}


def test_step_does_not_clip_again_after_the_operator_clipped(references):
    model, stats = train_epoch_of(local_trainer(ClipsItself))
    ref_model, ref_norms = references["unclipped"]  # the operator's own clip acted, not MAX_NORM's
    assert max_diff(model, ref_model) < TOLERANCE
    assert stats["grad_norm"] == pytest.approx(sum(ref_norms) / len(ref_norms), rel=1e-4)


class DirectStep(TrainingOperator):
    """RaySGD's examples verbatim: ``loss.backward()`` and ``optimizer.step()``."""

    def train_batch(self, batch, batch_info):
        self.optimizer.zero_grad()
        loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item(), "num_samples": _num_samples(batch)}


class DirectBackward(TrainingOperator):
    def train_batch(self, batch, batch_info):
        self.zero_grad()
        loss = self.model(**batch).loss
        loss.backward()
        self.step()
        return {"loss": loss.item(), "num_samples": _num_samples(batch)}


class OwnEpochAccumulating(OwnEpoch):
    pass


@pytest.mark.parametrize(
    ("operator", "options", "match"),
    [
        pytest.param(
            DirectStep,
            {"gradient_accumulation_steps": 1},
            r"max_grad_norm=0\.3, which the operator's self\.step\(\) applies.*train_batch "
            r"stepped without calling it.*drop max_grad_norm",
            id="optimizer.step-with-max_grad_norm",
        ),
        pytest.param(
            DirectStep,
            {"max_grad_norm": None},
            r"gradient_accumulation_steps=2.*drop gradient_accumulation_steps",
            id="optimizer.step-with-accumulation",
        ),
        pytest.param(
            DirectBackward,
            {"max_grad_norm": None},
            r"no self\.backward\(loss\) since the last step.*gradient_accumulation_steps=2.*"
            r"Call self\.backward\(loss\) instead of loss\.backward\(\)",
            id="loss.backward-with-accumulation",
        ),
        pytest.param(
            OwnEpochAccumulating,
            {},
            r"gradient_accumulation_steps=2 groups the batches of the trainer's loop.*Override "
            r"train_batch instead of train_epoch",
            id="own-train_epoch-with-accumulation",
        ),
    ],
)
def test_a_step_that_goes_around_an_option_is_refused(operator, options, match):
    trainer = local_trainer(operator, **options)
    try:
        with pytest.raises(StepOptionError, match=match) as info:
            trainer.train()
    finally:
        trainer.shutdown()
    assert isinstance(info.value, ValueError)


def test_without_those_options_a_direct_step_trains_as_written():
    model, stats = train_epoch_of(
        local_trainer(DirectStep, max_grad_norm=None, gradient_accumulation_steps=1)
    )
    assert math.isfinite(stats["loss"]) and "grad_norm" not in stats


# ------------------------------------------------------ two optimizers, clipped one by one
def two_models(config):
    torch.manual_seed(3)
    return torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)


def two_sgds(models, config):
    return tuple(torch.optim.SGD(model.parameters(), lr=0.5) for model in models)


def pairs(config):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g)
    y = 4 * x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=config["batch_size"]
    )


class TwoSteps(TrainingOperator):
    """A GAN-like step: each model's loss, backward and its own optimizer's step."""

    def train_batch(self, batch, batch_info):
        x, y = batch
        self.zero_grad()
        losses = []
        for index, model in enumerate(self.models):
            loss = torch.nn.functional.mse_loss(model(x) * (index + 1), y)
            self.backward(loss)
            self.step(index)
            losses.append(loss.item())
        return {"loss": sum(losses), "num_samples": len(y)}


def test_two_optimizers_stepped_apart_are_clipped_apart():
    trainer = TorchTrainer(
        model_creator=two_models,
        data_creator=pairs,
        optimizer_creator=two_sgds,
        training_operator_cls=TwoSteps,
        config={"batch_size": 16},
        num_workers=0,
        max_grad_norm=1.0,
    )
    try:
        stats = trainer.train()
        trained = trainer.get_model()
    finally:
        trainer.shutdown()
    models = two_models({})
    optimizers = two_sgds(models, {})
    norms: list[list[float]] = [[], []]
    for x, y in pairs({"batch_size": 16}):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for index, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            torch.nn.functional.mse_loss(model(x) * (index + 1), y).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norms[index].append(float(norm))
            optimizer.step()
    assert min(min(n) for n in norms) > 1.0  # every step clips
    for index in (0, 1):
        assert stats[f"grad_norm_{index}"] == pytest.approx(sum(norms[index]) / 4, rel=1e-5)
        assert max_diff(trained[index], models[index]) < 1e-6
