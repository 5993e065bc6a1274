"""The language-model step's options, batches and FSDP units, without workers (issue 25)."""

from __future__ import annotations

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.core.precision import MixedPrecision, amp_dtype, default_precision
from polytrain.backends.core.step_options import MicroBatch, StepOptions, step_options
from polytrain.backends.deepspeed.config import DeepSpeedConfig
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.backends.fsdp.wrap import block_classes, block_units, repeated_blocks
from polytrain.errors import ConfigError
from polytrain.trainer_api.options.run_config import load_config
from polytrain.trainer_api.torch.default_step import batch_counts, micro_batches, model_loss
from tests.helpers import DIGITS


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_grad_norm": -1}, r"max_grad_norm=-1 .*positive, finite.*None.*max_grad_norm=1\.0"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm=0\.0 "),
        ({"max_grad_norm": float("inf")}, r"max_grad_norm=inf "),
        ({"max_grad_norm": "1"}, r"max_grad_norm must be a positive number.*str: '1'"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0 .*int >= 1.*=4"),
        ({"gradient_accumulation_steps": 1.5}, r"gradient_accumulation_steps=1\.5 "),
        ({"precision": "bf17"}, r"precision='bf17' .*'fp32', 'bf16', 'fp16'.*Pass one"),
        ({"precision": "bf16", "use_fp16": True}, r"use_fp16=True .*precision='bf16'.*Drop"),
    ],
)
def test_bad_step_values_fail_at_construction(kwargs, message):
    """Before any worker starts: the trainer's first check (no Ray here)."""
    with pytest.raises(ConfigError, match=message):
        TorchTrainer(**DIGITS, num_workers=2, **kwargs)


def test_use_fp16_is_precision_fp16_and_sets_the_context():
    assert step_options(use_fp16=True).precision == "fp16"
    assert step_options().precision == "fp32" and not step_options().mixed
    ctx = WorkerContext.from_scaling(_scaling(), step=StepOptions(precision="bf16"))
    assert ctx.use_fp16 and ctx.step.precision == "bf16"


def test_run_config_takes_the_step_keywords():
    path = "examples/configs/ddp.yaml"
    run = load_config(path, ["max_grad_norm=1", "gradient_accumulation_steps=2", "precision=bf16"])
    kwargs = run.trainer_kwargs(TorchTrainer)
    assert (kwargs["max_grad_norm"], kwargs["gradient_accumulation_steps"]) == (1, 2)
    assert kwargs["precision"] == "bf16"
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=0 "):
        load_config(path, ["gradient_accumulation_steps=0"])


def test_a_torch_section_carries_the_step_keywords(tmp_path):
    """They are torch-only: a config for both frameworks keeps them in its torch: section."""
    path = tmp_path / "both.yaml"
    path.write_text(
        "config: {batch_size: 64}\n"
        "torch: {model: a.b:m, data: a.b:d, optimizer: a.b:o, max_grad_norm: 0.5, "
        "gradient_accumulation_steps: 4, precision: bf16}\n"
        "tensorflow: {model: c.d:m, data: c.d:d}\n"
    )
    run = load_config(path)
    assert (run.max_grad_norm, run.gradient_accumulation_steps, run.precision) == (0.5, 4, "bf16")
    tf_run = load_config(path, ["backend=mwms"])
    assert (tf_run.max_grad_norm, tf_run.precision) == (None, None)
    with pytest.raises(ConfigError, match=r"precision='bf17' is not supported"):
        load_config(path, ["torch.precision=bf17"])


# ------------------------------------------------------------------ precision
def _scaling():
    from polytrain.trainer_api.options.configs import ScalingConfig

    return ScalingConfig(num_workers=1)


def _ctx(precision: str, device: str) -> WorkerContext:
    ctx = WorkerContext.from_scaling(_scaling(), step=StepOptions(precision=precision))
    ctx.device = torch.device(device)
    return ctx


def test_bf16_is_selectable_on_gpu_and_cpu_without_a_scaler():
    assert amp_dtype(_ctx("bf16", "cuda")) is torch.bfloat16
    assert amp_dtype(_ctx("bf16", "cpu")) is torch.bfloat16
    assert amp_dtype(_ctx("fp16", "cpu")) is torch.bfloat16  # no fp16 kernels on CPU
    assert amp_dtype(_ctx("fp32", "cuda")) is None
    precision = default_precision(_ctx("bf16", "cpu"))
    assert isinstance(precision, MixedPrecision) and precision.scaler is None
    with precision.autocast():
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16


def test_deepspeed_config_follows_the_step_options():
    config = DeepSpeedConfig(stage=2)
    step = StepOptions(max_grad_norm=0.5, gradient_accumulation_steps=4, precision="bf16")
    ds = config.worker_config(8, 2, use_fp16=True, device_type="cuda", step=step)
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
    assert ds["train_batch_size"] == 8 * 4 * 2 and ds["bf16"] == {"enabled": True}
    assert "fp16" not in ds
    fp16 = config.worker_config(8, 2, use_fp16=True, device_type="cuda", step=StepOptions())
    assert fp16["fp16"]["enabled"] and fp16["gradient_clipping"] == 0.0
    own = DeepSpeedConfig(config={"gradient_clipping": 2.0})
    with pytest.raises(ConfigError, match=r"max_grad_norm=0\.5 disagrees.*gradient_clipping=2\.0"):
        own.worker_config(8, 2, use_fp16=False, device_type="cpu", step=step)


# -------------------------------------------------------------------- batches
def test_micro_batches_group_k_and_step_on_the_remainder():
    grouped = [(b, (m.index, m.size)) for b, m in micro_batches(range(5), 2)]
    assert grouped == [(0, (0, 2)), (1, (1, 2)), (2, (0, 2)), (3, (1, 2)), (4, (0, 1))]
    assert [m.last for _, m in micro_batches(range(3), 1)] == [True] * 3
    assert MicroBatch(0, 1).first and MicroBatch(0, 1).last


def test_token_counts_and_model_loss():
    ids = torch.ones(3, 5, dtype=torch.long)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    assert batch_counts({"input_ids": ids, "attention_mask": mask}, None) == {
        "num_samples": 3,
        "num_tokens": 13,
    }
    labels = ids.clone()
    labels[:, :2] = -100
    assert batch_counts({"input_ids": ids, "labels": labels}, labels)["num_tokens"] == 9
    assert batch_counts((torch.zeros(4, 2), torch.zeros(4)), torch.zeros(4)) == {"num_samples": 4}
    assert model_loss({"loss": torch.tensor(2.0)}).item() == 2.0
    with pytest.raises(ValueError, match=r"without a loss.*no loss_creator.*'labels'"):
        model_loss(torch.zeros(2))


# ---------------------------------------------------------------- FSDP units
class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_repeated_blocks_are_the_units_and_the_tied_weights_stay_in_the_root():
    model = Tied()
    assert repeated_blocks(model) == {Block}
    units = block_units(model, block_classes(model, "auto"))
    assert units == list(model.blocks)
    assert block_classes(model, ["Block"]) == {Block} == block_classes(model, [Block])
    assert block_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)), "auto") is None
    with pytest.raises(ConfigError, match=r"names 'NoSuchBlock'.*Its module classes: .*'Block'"):
        block_classes(model, ("NoSuchBlock",))
    with pytest.raises(ConfigError, match=r"'transformer' found no repeated blocks"):
        block_classes(torch.nn.Linear(2, 2), "transformer")


def test_fsdp_auto_wrap_policy_values():
    assert FSDPConfig().auto_wrap_policy == "auto"
    assert FSDPConfig(auto_wrap_policy=["GPT2Block"]).auto_wrap_policy == ("GPT2Block",)
    with pytest.raises(ConfigError, match=r"\('blocks'\).*'auto', 'transformer'.*\['GPT2Block'\]"):
        FSDPConfig(auto_wrap_policy="blocks")
    with pytest.raises(ConfigError, match=r"must hold nn.Module classes or class names.*\[3\]"):
        FSDPConfig(auto_wrap_policy=[3])


def test_backend_settings_that_clash_with_the_step_options_fail_at_construction():
    with pytest.raises(ConfigError, match=r"backward_passes_per_step=2 would accumulate twice"):
        TorchTrainer(
            **DIGITS,
            num_workers=2,
            backend="horovod",
            backend_config={"backward_passes_per_step": 2},
            gradient_accumulation_steps=2,
        )
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2 disagrees.*=4"):
        TorchTrainer(
            **DIGITS,
            num_workers=2,
            backend="deepspeed",
            backend_config={"config": {"gradient_accumulation_steps": 4}},
            gradient_accumulation_steps=2,
        )
