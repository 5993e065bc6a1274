"""GPU paths: NCCL process groups, one GPU per worker, fp16 with a GradScaler.

Skipped (not failed) on machines without a CUDA device; see tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.registry import get_spec
from tests.helpers import (
    DIGITS,
    adam_optimizer_creator,
    max_param_diff,
    parity_data_creator,
    parity_model_creator,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_start_4_cpus")]

GPU_CASES = [
    ("ddp", None),
    ("horovod", None),
    ("fairscale", {"mode": "sddp"}),
    ("fairscale", {"mode": "fsdp"}),
    ("fsdp", None),  # FSDP2 (fully_shard)
    ("fsdp", {"version": 1}),  # FSDP1 (FullyShardedDataParallel)
    ("deepspeed", {"stage": 2}),
]


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(("backend", "backend_config"), GPU_CASES)
@pytest.mark.parametrize("use_fp16", [False, True])
def test_trains_on_gpus(ray_start_4_cpus, backend, backend_config, use_fp16, tmp_path):
    if not get_spec(backend).installed:
        pytest.skip(f"{backend} is not installed")
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    workers = min(2, _num_gpus())
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=workers,
        use_gpu=True,
        use_fp16=use_fp16,
        backend=backend,
        backend_config=backend_config,
    )
    try:
        devices = trainer.apply_all_operators(lambda op: str(op.device))
        first = trainer.train()
        for _ in range(3):
            last = trainer.train()
        val = trainer.validate()
        path = trainer.save(tmp_path / "gpu.pt")
    finally:
        trainer.shutdown()
    assert all(device.startswith("cuda") for device in devices)
    assert last["loss"] < first["loss"]
    assert val["val_accuracy"] > 0.8
    cpu = TorchTrainer(**DIGITS, config={"batch_size": 64}, num_workers=0)
    try:
        cpu.load(path)  # a GPU checkpoint loads on CPU
        assert abs(cpu.validate()["val_loss"] - val["val_loss"]) < 1e-2
    finally:
        cpu.shutdown()


def test_ddp_uses_nccl(ray_start_4_cpus):
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    trainer = TorchTrainer(**DIGITS, config={"batch_size": 64}, num_workers=1, use_gpu=True)
    try:
        backends = trainer.apply_all_workers(
            lambda: torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        )
    finally:
        trainer.shutdown()
    assert backends == ["nccl"]


# --------------------------------------------------------------------- FSDP2
def _fsdp2_facts(operator) -> dict:
    """How FSDP2 holds the model on a GPU worker, and what its forward computes in."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    model = operator.model
    params = list(model.parameters())
    model.eval()
    with torch.no_grad():
        out = model(torch.zeros(2, 64, device=operator.device))
    model.train()
    scaler = operator.components.scaler
    return {
        "process_group": dist.get_backend(),
        "fully_shard": isinstance(model, FSDPModule),
        "kinds": sorted({type(p).__name__ for p in params}),
        "mesh": sorted({p.device_mesh.device_type for p in params}),
        "shard_devices": sorted({p.to_local().device.type for p in params}),
        "shard_dtypes": sorted({str(p.dtype) for p in params}),
        "forward_dtype": str(out.dtype),
        "scaler": type(scaler).__name__ if scaler is not None else None,
    }


@pytest.mark.parametrize("use_fp16", [False, True], ids=["fp32", "fp16-policy"])
def test_fsdp2_on_gpus_nccl_mixed_precision_policy_and_checkpoints(
    ray_start_4_cpus, use_fp16, tmp_path
):
    """fully_shard on a CUDA mesh over nccl; fp16 MixedPrecisionPolicy with fp32 shards.

    Its sharded checkpoint directory loads on CPU under ddp at one worker.
    """
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=min(2, _num_gpus()),
        use_gpu=True,
        use_fp16=use_fp16,
        backend="fsdp",
        checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt")},
    )
    try:
        facts = trainer.apply_all_operators(_fsdp2_facts)
        first = trainer.train()
        for _ in range(2):
            last = trainer.train()
        path = last["checkpoint_path"]
        val = trainer.validate()
    finally:
        trainer.shutdown()
    expected = {
        "process_group": "nccl",
        "fully_shard": True,
        "kinds": ["DTensor"],
        "mesh": ["cuda"],
        "shard_devices": ["cuda"],
        "shard_dtypes": ["torch.float32"],
        "forward_dtype": "torch.float16" if use_fp16 else "torch.float32",
        "scaler": "GradScaler" if use_fp16 else None,
    }
    assert facts == [expected] * len(facts)
    assert last["loss"] < first["loss"]
    assert val["val_accuracy"] > 0.8
    cpu = TorchTrainer(**DIGITS, config={"batch_size": 64}, num_workers=1, backend="ddp")
    try:
        cpu.load(path)  # a sharded GPU directory, read range by range on CPU
        assert abs(cpu.validate()["val_loss"] - val["val_loss"]) < 1e-2
    finally:
        cpu.shutdown()


def test_fsdp2_matches_ddp_on_gpus(ray_start_4_cpus):
    """Same seed, data and global batch: FSDP2 and DDP on nccl end with the same weights."""
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")

    def run(backend):
        trainer = TorchTrainer(
            model_creator=parity_model_creator,
            data_creator=parity_data_creator,
            optimizer_creator=adam_optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"lr": 0.01, "batch_size": 32},
            num_workers=min(2, _num_gpus()),
            use_gpu=True,
            backend=backend,
        )
        try:
            trainer.train()
            return trainer.get_model()
        finally:
            trainer.shutdown()

    # nccl's reduction order differs from DDP's allreduce: not bit-identical
    assert max_param_diff(run("fsdp"), run("ddp")) <= 1e-4


def _meta_init_run(backend: str, backend_config: dict, tag: str, precision: str) -> dict:
    """A 2-layer GPT-2 on nccl: its weights after set-up, what each rank's creator saw, losses."""
    from tests.integration import test_meta_init as lm

    trainer = TorchTrainer(
        model_creator=lm.gpt2_creator,
        data_creator=lm.data_creator,
        optimizer_creator=lm.adam_creator,
        config={"batch_size": lm.BATCH, "tag": tag},
        num_workers=min(2, _num_gpus()),
        use_gpu=True,
        precision=precision,
        backend=backend,
        backend_config=backend_config,
    )
    try:
        devices = trainer.apply_all_operators(lambda op: str(op.device))
        weights = trainer.state_dict()["models"][0]
        seen = [s[tag][rank] for rank, s in enumerate(trainer.apply_all_operators(lm._seen))]
        tied = trainer.apply_all_operators(lm._tied)
        losses = lm._train_losses(trainer)
    finally:
        trainer.shutdown()
    assert all(device.startswith("cuda") for device in devices)
    assert tied == [True] * len(tied)
    return {"weights": weights, "seen": seen, "losses": losses}


def _assert_built_on_rank0_only(seen: list, meta: bool) -> None:
    full = seen[0][0]["full"]
    assert seen[0][0] == {"meta": False, "stored": full, "full": full}
    for builds in seen[1:]:  # no other rank ever held the full weights
        assert builds and all(b["stored"] == 0 and b["meta"] is meta for b in builds)


def test_fsdp2_by_block_bf16_on_nccl_builds_the_model_on_rank0_only(ray_start_4_cpus):
    """init_on_rank0 under fully_shard by GPT2Block with a bf16 policy: rank 0's weights, exactly."""
    pytest.importorskip("transformers")
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    from tests.integration import test_meta_init as lm

    options = {"auto_wrap_policy": ["GPT2Block"]}
    run = _meta_init_run("fsdp", options, "gpu-fsdp2", "bf16")
    expected = lm.gpt2_creator({}).state_dict()
    for name, tensor in expected.items():  # fp32 shards: bit for bit
        assert torch.equal(run["weights"][name].cpu(), tensor), name
    _assert_built_on_rank0_only(run["seen"], meta=True)
    today = _meta_init_run("fsdp", {**options, "init_on_rank0": False}, "gpu-fsdp2-all", "bf16")
    assert run["losses"] == pytest.approx(today["losses"], rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_on_gpus_builds_the_model_under_zero_init(ray_start_4_cpus, precision):
    """ZeRO-3 on nccl: every rank builds under zero.Init, and gets rank 0's weights."""
    pytest.importorskip("transformers")
    if not get_spec("deepspeed").installed:
        pytest.skip("deepspeed is not installed")
    if ray_start_4_cpus.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test Ray instance sees no GPU")
    from tests.integration import test_meta_init as lm

    run = _meta_init_run("deepspeed", {"stage": 3}, f"gpu-zero3-{precision}", precision)
    today = _meta_init_run(
        "deepspeed", {"stage": 3, "init_on_rank0": False}, f"gpu-zero3-all-{precision}", precision
    )
    # bf16: both paths round rank 0's fp32 weights to bf16 parameters the same way
    expected = today["weights"] if precision == "bf16" else lm.gpt2_creator({}).state_dict()
    for name, tensor in expected.items():
        assert torch.equal(run["weights"][name].cpu(), tensor.cpu()), name
    _assert_built_on_rank0_only(run["seen"], meta=False)
    assert run["losses"] == pytest.approx(today["losses"], rel=1e-5)
