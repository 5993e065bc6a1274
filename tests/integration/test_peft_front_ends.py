"""A ``peft`` LoRA model on the other front ends: a polytrain Lightning strategy and the
function API (``polytrain.train``), each with 2 workers equal to one process (issue 40.5).

The model is a tiny GPT-2 (from a config) with LoRA on ``c_attn``; the data fixed-length
token sequences (every worker holds as many trained tokens, so the backends' mean over
workers is the one-process mean). Equal means: the adapters within 1e-5 of one process's,
the base weights bit-identical to the start (frozen), the per-step losses (function API)
within 1e-5 relative. The default run takes ddp on both front ends and the sharded
Lightning strategy; make test-long every backend of each.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.instruction_helpers import tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

VOCAB = 32
SEQ_LEN = 16
SAMPLES = 64
GLOBAL_BATCH = 8
STEPS = 4
LR = 2.0  # large: the adapters move far from their start (and apart for another order)


def sequences() -> torch.utils.data.TensorDataset:
    """Arithmetic token sequences (a learnable task), fixed by the seed."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    step = torch.randint(1, 4, (SAMPLES, 1), generator=g)
    ids = (start + step * torch.arange(SEQ_LEN)) % VOCAB
    return torch.utils.data.TensorDataset(ids)


def lora_gpt2() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
    torch.manual_seed(0)
    base = tiny_gpt2(VOCAB, n_positions=SEQ_LEN)
    # peft initialises lora_B at zero: one step moves only B; start B random so that both
    # adapter matrices get gradients from the first step on.
    model = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def one_process(order: list[int] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process, the global batch (samples in ``order``), SGD over the adapters."""
    model = lora_gpt2()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = torch.utils.data.DataLoader(sequences(), batch_size=GLOBAL_BATCH, sampler=order)
    losses = []
    for step, (ids,) in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_lora_weights(weights: dict[str, torch.Tensor], reference_weights, initial) -> None:
    assert weights.keys() == reference_weights.keys()
    adapters = [k for k in weights if "lora_" in k]
    assert adapters, "no adapter weights"
    for key in adapters:
        torch.testing.assert_close(weights[key], reference_weights[key], rtol=0, atol=1e-5)
        assert not torch.equal(weights[key], initial[key]), f"{key} did not train"
    for key in weights.keys() - set(adapters):  # the frozen base
        assert torch.equal(weights[key], initial[key]), f"base weight {key} changed"


# ---------------------------------------------------------------- Lightning
# (id, strategy class name in polytrain.lightning, registry name of its backend)
LIGHTNING = [
    ("ddp", "RayStrategy", "ddp"),
    ("horovod", "RayHorovodStrategy", "horovod"),
    ("sharded", "RayShardedStrategy", "fairscale"),
    ("deepspeed", "RayDeepSpeedStrategy", "deepspeed"),
]


def _cases(cases, every_run):
    from polytrain.backends.registry import get_spec

    params = []
    for case_id, *rest in cases:
        spec = get_spec(rest[-1])
        marks = [pytest.mark.skipif(not spec.installed, reason=f"{spec.name} is not installed")]
        if case_id not in every_run:
            marks.append(pytest.mark.long_matrix)
        params.append(pytest.param(*rest, id=case_id, marks=marks))
    return params


# sharded runs every time too: Lightning's zero_grad hook once broke its ShardedDataParallel.
@pytest.mark.parametrize(("strategy_name", "backend"), _cases(LIGHTNING, {"ddp", "sharded"}))
def test_lora_model_under_a_ray_strategy_on_two_workers_equals_one_process(
    strategy_name, backend, tmp_path, monkeypatch, no_leftover_actors
):
    pl = pytest.importorskip("pytorch_lightning")
    from polytrain import lightning

    class LoraModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = lora_gpt2()

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.model, batch[0])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

        def train_dataloader(self):
            # The per-worker batch; Lightning adds a distributed sampler, which shuffles
            # training data (seed PL_GLOBAL_SEED): rank r takes perm[r], perm[r + 2], ...
            return torch.utils.data.DataLoader(
                sequences(), batch_size=GLOBAL_BATCH // 2, shuffle=False
            )

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    module = LoraModule()
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = pl.Trainer(
        strategy=getattr(lightning, strategy_name)(num_workers=2),
        max_steps=STEPS,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    assert trainer.global_step == STEPS
    # DistributedSampler(shuffle=True, seed=0)'s order at epoch 0: each step of the two
    # workers holds the next 8 samples of it.
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    _, reference_weights = one_process(order)
    check_lora_weights(module.model.state_dict(), reference_weights, initial)


# ---------------------------------------------------------------- function API
FUNCTION_API = [
    ("ddp", "ddp"),
    ("horovod", "horovod"),
    ("fairscale", "fairscale"),
    ("fsdp", "fsdp"),
    ("deepspeed", "deepspeed"),
]


def lora_loop(config):
    from polytrain.hf.data import sum_over_workers
    from polytrain.train import Checkpoint, get_context, report
    from polytrain.train import torch as train_torch

    world = get_context().get_world_size()
    loader = train_torch.prepare_data_loader(
        torch.utils.data.DataLoader(sequences(), batch_size=GLOBAL_BATCH // world, shuffle=False)
    )
    model = lora_gpt2()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    if config["backend"] == "ddp":  # Ray Train's usual pair
        model = train_torch.prepare_model(model)
        optimizer = train_torch.prepare_optimizer(optimizer)
    else:  # backends that wrap the optimizer too
        model, optimizer = train_torch.prepare(model, optimizer, data_loader=loader)
    for step, (ids,) in enumerate(loader):
        if step == STEPS:
            break
        train_torch.zero_grad()
        loss = lm_loss(model, ids)
        train_torch.backward(loss)
        train_torch.step()
        (total,), _ = sum_over_workers([loss.item()], train_torch.get_device())
        if step < STEPS - 1:
            report({"loss": total / world})
    state = train_torch.full_state_dict()  # collective: every rank calls it
    with tempfile.TemporaryDirectory() as d:
        if state is not None:
            torch.save(state["models"][0], os.path.join(d, "model.pt"))
        report({"loss": total / world}, checkpoint=Checkpoint.from_directory(d))


@pytest.mark.parametrize("backend", _cases(FUNCTION_API, {"ddp"}))
def test_lora_model_through_the_function_api_on_two_workers_equals_one_process(
    backend, tmp_path, no_leftover_actors
):
    from polytrain.train import RunConfig, ScalingConfig
    from polytrain.train.torch import TorchTrainer

    result = TorchTrainer(
        lora_loop,
        train_loop_config={"backend": backend},
        backend=backend,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="lora"),
    ).fit()
    assert result.error is None and result.checkpoint is not None
    losses, reference_weights = one_process()  # no shuffling: the samples in order
    assert [m["loss"] for m in result.metrics_history] == pytest.approx(losses, rel=1e-5)
    with result.checkpoint.as_directory() as d:
        weights = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    check_lora_weights(weights, reference_weights, lora_gpt2().state_dict())
