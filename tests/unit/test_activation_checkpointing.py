"""``activation_checkpointing=`` and ``compile=``: values, the model surgery, the refusals (no Ray)."""

from __future__ import annotations

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.core.blocks import CHECKPOINTED, apply_activation_checkpointing
from polytrain.backends.core.step_options import step_options
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.run_config import load_config
from tests.helpers import DIGITS


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * scale


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


def _grads(spec) -> tuple[Stack, list[torch.Tensor]]:
    model = Stack()
    assert apply_activation_checkpointing(model, spec) == ([] if not spec else ["Block"])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    return model, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("spec", [True, ["Block"], [Block]])
def test_checkpointed_blocks_recompute_and_give_the_same_gradients(spec):
    plain, plain_grads = _grads(False)
    model, grads = _grads(spec)
    assert [b.calls for b in plain.blocks] == [1, 1, 1]
    assert [b.calls for b in model.blocks] == [2, 2, 2]  # forward + recomputation in backward
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    assert all(getattr(b, CHECKPOINTED) for b in model.blocks)
    assert list(model.state_dict()) == list(plain.state_dict())  # names unchanged
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert [b.calls for b in model.blocks] == [3, 3, 3]  # no recomputation without grad


def test_bad_values_name_the_value_and_the_models_classes():
    with pytest.raises(ConfigError, match=r"names 'NoSuchBlock', but Stack .*\['Block', "):
        apply_activation_checkpointing(Stack(), ("NoSuchBlock",))
    with pytest.raises(ConfigError, match=r"True found neither .* in Linear.*\['Linear'\]"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), True)


@pytest.mark.parametrize("value", [3, [], [1], {"Block": True}])
def test_a_wrong_type_fails_at_construction(value):
    with pytest.raises(ConfigTypeError, match=r"activation_checkpointing must be True, False or"):
        TorchTrainer(**DIGITS, num_workers=2, activation_checkpointing=value)


def test_step_values_and_run_config_keys():
    assert step_options(activation_checkpointing=["GPT2Block"]).activation_checkpointing == (
        "GPT2Block",
    )
    assert step_options(activation_checkpointing=None).activation_checkpointing is False
    run = load_config(
        "examples/configs/ddp.yaml", ["activation_checkpointing=true", "compile=true"]
    )
    kwargs = run.trainer_kwargs(TorchTrainer)
    assert kwargs["activation_checkpointing"] is True and kwargs["compile"] is True
    with pytest.raises(ConfigError, match=r"compile"):
        load_config("examples/configs/ddp.yaml", ["compile=3"])


@pytest.mark.parametrize(
    ("backend", "backend_config", "named"),
    [
        ("fsdp", {"version": 1}, r"fsdp backend with version=1: .*use_orig_params"),
    ],
)
def test_compile_is_refused_where_the_backend_cannot(backend, backend_config, named):
    with pytest.raises(ConfigError, match=rf"compile=True is not supported by the {named}"):
        TorchTrainer(
            **DIGITS, num_workers=2, backend=backend, backend_config=backend_config, compile=True
        )


def test_fairscale_fsdp_mode_refuses_compile():
    """Checked directly: on CPU the mode is refused earlier (it needs CUDA)."""
    from polytrain.backends.fairscale.backend import FairscaleBackend

    with pytest.raises(ConfigError, match=r"fairscale backend with mode='fsdp': .*'sddp'"):
        FairscaleBackend({"mode": "fsdp"}).validate_compile()
    FairscaleBackend({"mode": "sddp"}).validate_compile()
