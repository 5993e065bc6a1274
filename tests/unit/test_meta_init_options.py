"""The ``init_on_rank0`` options and the meta-device helpers, without Ray or a process group."""

from __future__ import annotations

import pytest
import torch

from polytrain.backends.core import meta_init
from polytrain.backends.core.context import WorkerContext
from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.errors import ConfigError, CreatorError


def test_fsdp_builds_on_rank0_by_default_unless_each_rank_keeps_its_weights():
    assert FSDPConfig().init_on_rank0 is True
    assert FSDPConfig(version=1).init_on_rank0 is True
    assert FSDPConfig(sync_module_states=False).init_on_rank0 is False
    assert FSDPConfig(init_on_rank0=False).init_on_rank0 is False


def test_fsdp_refuses_a_contradiction_and_a_non_bool():
    with pytest.raises(ConfigError, match="contradicts sync_module_states=False"):
        FSDPConfig(sync_module_states=False, init_on_rank0=True)
    with pytest.raises(ConfigError, match="init_on_rank0 must be True, False or None.*'yes'"):
        FSDPConfig(init_on_rank0="yes")


def test_deepspeed_builds_under_zero_init_on_stage_3_only():
    config = pytest.importorskip("polytrain.backends.deepspeed.config")
    assert config.DeepSpeedConfig(stage=3).builds_on_rank0()
    assert config.DeepSpeedConfig(config={"zero_optimization": {"stage": 3}}).builds_on_rank0()
    assert not config.DeepSpeedConfig(stage=3, init_on_rank0=False).builds_on_rank0()
    assert not config.DeepSpeedConfig(stage=2).builds_on_rank0()
    with pytest.raises(ConfigError, match="needs ZeRO stage 3.*stage 2"):
        config.DeepSpeedConfig(stage=2, init_on_rank0=True)


def test_the_zero_init_config_leaves_out_the_batch_sizes_the_loader_decides():
    config = pytest.importorskip("polytrain.backends.deepspeed.config")
    ds = config.DeepSpeedConfig(stage=3, config={"train_micro_batch_size_per_gpu": 8})
    placeholder = ds.worker_config(None, 2, use_fp16=False, device_type="cpu")
    assert placeholder["train_micro_batch_size_per_gpu"] == 1
    assert placeholder["train_batch_size"] == 2
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=8"):
        ds.worker_config(4, 2, use_fp16=False, device_type="cpu")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def test_materialize_gives_storage_and_keeps_ties():
    with torch.device("meta"):
        model = Tied()
    assert meta_init.on_meta(model)
    assert meta_init.tie_groups(model) == [[("embed", "weight"), ("head", "weight")]]
    meta_init.materialize(model, torch.device("cpu"))
    assert not meta_init.on_meta(model)
    assert model.head.weight is model.embed.weight


def test_fsdp1_param_init_fn_goes_module_by_module_and_keeps_ties():
    with torch.device("meta"):
        model = Tied()
    init = meta_init.meta_param_init_fn(torch.device("cpu"))
    for module in model.modules():
        init(module)
    assert not meta_init.on_meta(model)
    assert model.head.weight is model.embed.weight


def test_a_creator_that_reads_values_fails_naming_the_rank_and_the_option():
    def creator():
        model = torch.nn.Linear(2, 2)
        return model if model.weight.sum().item() < 10 else None

    ctx = WorkerContext(world_rank=1, world_size=2)
    with pytest.raises(CreatorError) as info:
        meta_init.build_on_meta(creator, ctx, "backend_config={'init_on_rank0': False}")
    message = str(info.value)
    assert "rank 1" in message and "meta" in message and ".item()" in message
    assert "init_on_rank0': False" in message
