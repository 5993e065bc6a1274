"""Backends as Accelerate sees them: the environment each maps to, read back by Accelerate itself.

No Ray and no process group: Accelerate's own plugins are built from the
environment a backend gives, so a wrong variable name or value fails here.
"""

from __future__ import annotations

import base64
import json
import os

import pytest

from polytrain.backends.registry import get_backend
from polytrain.errors import ConfigError

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def patched_env():
    """Set variables for one test and restore the environment after it."""
    saved = dict(os.environ)

    def apply(env):
        os.environ.update(env)

    yield apply
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(
    ("backend_config", "expected"),
    [
        (
            {"version": 2, "sharding_strategy": "SHARD_GRAD_OP", "auto_wrap_policy": ["GPT2Block"]},
            {
                "fsdp_version": 2,
                "reshard_after_forward": False,
                "wrap": ["GPT2Block"],
                "rank0": True,
            },
        ),
        (
            # (sync_module_states=True needs a GPU for Accelerate's FSDP1 plugin to build)
            {
                "version": 1,
                "sharding_strategy": "NO_SHARD",
                "auto_wrap_policy": "size_based",
                "sync_module_states": False,
            },
            {"fsdp_version": 1, "sharding": "NO_SHARD", "min_num_params": 100_000, "rank0": False},
        ),
    ],
)
def test_fsdp_options_reach_accelerates_fsdp_plugin(patched_env, backend_config, expected):
    from accelerate.utils import FullyShardedDataParallelPlugin

    env = get_backend("fsdp", backend_config).accelerate_env(use_gpu=True)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    patched_env(env)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == expected["fsdp_version"]
    assert plugin.cpu_ram_efficient_loading is expected["rank0"]  # init_on_rank0
    if "reshard_after_forward" in expected:
        assert plugin.reshard_after_forward is expected["reshard_after_forward"]
        assert plugin.transformer_cls_names_to_wrap == expected["wrap"]
    else:
        assert plugin.sync_module_states is False
        assert plugin.sharding_strategy.name == expected["sharding"]
        assert plugin.min_num_params == expected["min_num_params"]


def test_deepspeed_config_reaches_accelerates_deepspeed_plugin(patched_env):
    from accelerate.utils import DeepSpeedPlugin

    backend = get_backend(
        "deepspeed", {"stage": 3, "config": {"zero_optimization": {"overlap_comm": True}}}
    )
    env = backend.accelerate_env(use_gpu=True)
    sent = json.loads(base64.urlsafe_b64decode(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]))
    assert sent["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert sent["gradient_accumulation_steps"] == "auto"  # the HF Trainer fills it in
    assert sent["gradient_clipping"] == "auto"
    patched_env(env)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3
    assert plugin.deepspeed_config["zero_optimization"]["overlap_comm"] is True


def test_deepspeed_accumulation_set_on_the_backend_is_kept():
    backend = get_backend("deepspeed", {"stage": 1, "gradient_accumulation_steps": 4})
    env = backend.accelerate_env(use_gpu=True)
    sent = json.loads(base64.urlsafe_b64decode(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]))
    assert sent["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize(
    ("name", "config", "use_gpu", "reason"),
    [
        ("fsdp", None, False, "FSDP only on accelerators"),
        ("deepspeed", None, False, "DeepSpeed only on accelerators"),
        ("fsdp", {"version": 1, "limit_all_gathers": False}, True, "limit_all_gathers"),
        ("fsdp", {"init_on_rank0": False}, True, "cpu_ram_efficient_loading"),
        ("ddp", {"find_unused_parameters": True}, False, "ddp_find_unused_parameters"),
        ("horovod", None, False, "no Horovod mode"),
        ("fairscale", None, False, "no fairscale mode"),
    ],
)
def test_backends_accelerate_cannot_follow_are_refused_with_the_reason(
    name, config, use_gpu, reason
):
    try:
        backend = get_backend(name, config)
    except ImportError:
        pytest.skip(f"{name} is not installed")
    with pytest.raises(ConfigError, match=reason):
        backend.accelerate_env(use_gpu=use_gpu)


def test_ddp_needs_nothing_beyond_ranks_and_devices():
    assert get_backend("ddp").accelerate_env(use_gpu=False) == {}
    assert get_backend("ddp", {"dist_backend": "gloo"}).accelerate_env(use_gpu=True) == {}
