"""``polytrain launch --accelerate-config``: an ``accelerate launch`` script on Ray workers.

End to end (on the session's Ray instance): a DDP Accelerate config on CPU
(``distributed_type: MULTI_CPU``), two ranks, a rank that fails once and a
restart that resumes from the script's own ``save_state``; the final weights
equal one process's. The FSDP and DeepSpeed configs need GPUs under Accelerate:
their environment is checked here with Accelerate's own launcher functions, and
their refusal on CPU and against a contradicting ``--backend``.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from polytrain.errors import ConfigError
from tests.integration.test_launch import HERE, launch_cli

pytest.importorskip("accelerate")

from polytrain.backends.core.accelerate_launch import (  # noqa: E402
    AccelerateLaunchEnv,
    accelerate_launch_env,
    config_backend,
)

BASE = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": 1}
FSDP = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
    },
}
DEEPSPEED = {
    "distributed_type": "DEEPSPEED",
    "num_processes": 2,
    "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1},
}


def _config(tmp_path, **fields) -> str:
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({**BASE, "mixed_precision": "no", **fields}))
    return str(path)


@pytest.fixture(scope="module")
def ray_address(ray_start_4_cpus):
    return ray_start_4_cpus.get_runtime_context().gcs_address


def test_an_accelerate_script_restarts_and_equals_one_process(tmp_path, ray_address):
    from polytrain.train.huggingface.accelerate_scope import _reset_accelerate
    from tests.integration.accelerate_loop import ACCUMULATE, MICRO_BATCH, train_with_accelerate

    config = _config(tmp_path, distributed_type="MULTI_CPU", num_processes=2, use_cpu=True)
    script = str(HERE / "accelerate_launch_script.py")
    proc = launch_cli(
        ray_address, "-n", "2", "--max-restarts", "1", "--accelerate-config", config,
        script, str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 failed (exit code 3); restart 1 of 1" in proc.stderr
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["processes"] == 2
    reference_state, reference_losses, _ = train_with_accelerate(ACCUMULATE * MICRO_BATCH)
    _reset_accelerate()
    assert max(abs(a - b) for a, b in zip(final["losses"], reference_losses, strict=True)) <= 1e-6
    for name, value in reference_state.items():
        assert torch.allclose(final["state"][name], value, atol=1e-6), name


def test_fsdp_and_deepspeed_configs_become_accelerates_launch_environment(tmp_path):
    fsdp = accelerate_launch_env(_config(tmp_path, **FSDP), "FSDP", 2, use_gpu=True)
    assert fsdp["ACCELERATE_USE_FSDP"] == "true"
    assert fsdp["FSDP_VERSION"] == "2"
    assert fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "GPT2Block"
    assert fsdp["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert "MASTER_PORT" not in fsdp  # each launch gives rank 0's own
    ds = accelerate_launch_env(_config(tmp_path, **DEEPSPEED), "DEEPSPEED", 2, use_gpu=True)
    assert ds["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert ds["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"


@pytest.mark.parametrize(
    ("fields", "backend", "use_gpu", "message"),
    [
        (FSDP, "ddp", True, "which is the fsdp backend, but --backend ddp was given"),
        (DEEPSPEED, "fsdp", True, "which is the deepspeed backend, but --backend fsdp"),
        (FSDP, None, False, "needs GPUs"),
        ({"distributed_type": "MULTI_CPU", "use_cpu": True}, None, True, "trains on CPUs"),
        ({"distributed_type": "XLA"}, None, False, "cannot launch"),
    ],
)
def test_an_accelerate_config_that_contradicts_the_launch_is_refused(
    tmp_path, fields, backend, use_gpu, message
):
    with pytest.raises(ConfigError, match=message):
        config_backend(_config(tmp_path, **fields), backend, use_gpu)


def test_a_missing_accelerate_config_names_how_to_write_one(tmp_path):
    with pytest.raises(ConfigError, match="accelerate config --config_file"):
        AccelerateLaunchEnv(os.fspath(tmp_path / "nope.yaml"), None, False, 2)
