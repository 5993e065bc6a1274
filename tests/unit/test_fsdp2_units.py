"""The fsdp backend's version switch and FSDP2's option mapping, without Ray or a process group."""

from __future__ import annotations

import pytest
import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.backends.core.precision import MixedPrecision, Precision
from polytrain.backends.fsdp.backend import FSDPBackend
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.backends.fsdp.strategy_v1 import FSDP1Strategy
from polytrain.backends.fsdp.strategy_v2 import (
    FSDP2Strategy,
    mixed_precision_dtype,
    reshard_after_forward,
    wrap_units,
)
from polytrain.backends.registry import get_backend, get_spec
from polytrain.errors import ConfigError


# ---------------------------------------------------------------- config
def test_version_2_is_the_default_and_1_keeps_fsdp1():
    assert FSDPConfig().version == 2
    assert type(FSDPBackend().make_strategy()) is FSDP2Strategy
    assert type(FSDPBackend({"version": 1}).make_strategy()) is FSDP1Strategy
    assert type(get_backend("torch_fsdp", {"version": 2}).make_strategy()) is FSDP2Strategy


@pytest.mark.parametrize("version", [0, 3, "2", 2.0, True, None])
def test_a_bad_version_names_the_value_and_the_allowed_ones(version):
    with pytest.raises(ConfigError) as info:
        FSDPConfig(version=version)
    message = str(info.value)
    assert f"version ({version!r}) is not supported" in message
    assert "Must be 2 (fully_shard, FSDP2; the default) or 1 (FullyShardedDataParallel" in message


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"sharding_strategy": "no_shard"}, "sharding_strategy='NO_SHARD'"),
        ({"forward_prefetch": True}, "forward_prefetch=True"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False"),
    ],
)
def test_fsdp1_only_options_under_version_2_say_how_to_get_them(kwargs, setting):
    with pytest.raises(ConfigError, match=rf"{setting} is an FSDP1 option.*'version': 1"):
        FSDPConfig(**kwargs)
    FSDPConfig(version=1, **kwargs)  # accepted by FSDP1


def test_the_registry_runs_both_versions_in_the_shared_suite():
    cases = {case.id: case.backend_config for case in get_spec("fsdp").test_cases}
    assert cases == {"fsdp": None, "fsdp-v1": {"version": 1}}


# ----------------------------------------------------------- option mapping
def test_sharding_strategy_maps_to_reshard_after_forward():
    assert reshard_after_forward("FULL_SHARD") is True
    assert reshard_after_forward("SHARD_GRAD_OP") is False
    with pytest.raises(ConfigError, match=r"no sharding_strategy 'NO_SHARD'.*version 1"):
        reshard_after_forward("NO_SHARD")


def test_mixed_precision_is_fp16_on_gpu_bf16_on_cpu_and_off_without_use_fp16():
    assert mixed_precision_dtype(True, "cuda") is torch.float16
    assert mixed_precision_dtype(True, "cpu") is torch.bfloat16
    assert mixed_precision_dtype(False, "cuda") is None
    assert mixed_precision_dtype(False, "cpu") is None


def _linear(n: int) -> torch.nn.Linear:
    return torch.nn.Linear(n, n)  # n * n + n parameters


def test_size_policy_makes_every_big_enough_subtree_a_unit_children_first():
    torch.manual_seed(0)
    inner = torch.nn.Sequential(_linear(256), _linear(256))  # 65,792 parameters each
    model = torch.nn.Sequential(inner, torch.nn.ReLU(), _linear(256))
    assert wrap_units(model, "size_based", 50_000) == [inner[0], inner[1], model[2]]
    # neither Linear alone reaches 100,000; the pair below `inner` does
    assert wrap_units(model, "size_based", 100_000) == [inner]
    assert wrap_units(model, "size_based", 10**9) == []  # only the root
    assert wrap_units(model, "none", 1) == []


def test_size_policy_skips_containers_and_keeps_attention_whole():
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([_linear(64), _linear(64)])  # 4,160 each
            self.attention = torch.nn.MultiheadAttention(64, 4)  # 12,480 + out_proj 4,160

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.attention(x, x, x)[0]

    model = Blocks()
    units = wrap_units(model, "size_based", 5_000)
    # the ModuleList (8,320) is never called, so never a unit; out_proj is used by the
    # attention without being called, so the attention is one unit and out_proj none
    assert units == [model.attention]
    assert wrap_units(model, "size_based", 4_000) == [*model.layers, model.attention]


def test_a_shared_parameter_is_counted_once():
    first = _linear(100)  # 10,100 parameters
    second = torch.nn.Linear(100, 100, bias=False)
    second.weight = first.weight  # tied: adds nothing new
    model = torch.nn.Sequential(first, second)
    assert wrap_units(model, "size_based", 10_000) == [first]


# ------------------------------------------------------------- local mode
def test_local_mode_shards_nothing_and_autocasts():
    ctx = WorkerContext(local_mode=True, use_fp16=True)
    strategy = FSDPBackend().make_strategy()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    components = strategy.setup(Components(models=[model], optimizers=[optimizer]), ctx)
    assert components.models == [model] and components.optimizers == [optimizer]
    assert isinstance(components.precision, MixedPrecision)
    assert components.precision.cast_forward  # no MixedPrecisionPolicy here: autocast instead
    assert strategy.unwrap_model(model) is model
    assert isinstance(FSDP2Strategy().make_precision(WorkerContext(local_mode=True)), Precision)
