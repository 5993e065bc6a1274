"""The deepspeed backend on real Ray actors (gloo on CPU): ZeRO 1-3 against DDP.

One DDP run with Adam is the reference for every stage: parameters after 32
steps, optimizer-state bytes per rank, and the parameters after one more epoch
from its checkpoint. Each stage then trains the same steps, is compared with it,
saves a checkpoint that a 1-worker DDP trainer loads and continues, and loads
the DDP checkpoint and continues itself: both continuations must match DDP's,
which only holds when weights and Adam state both cross over faithfully.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.registry import get_spec
from polytrain.errors import ConfigError
from tests.helpers import (
    DIGITS,
    max_param_diff,
    parity_data_creator,
    parity_model_creator,
    parity_optimizer_creator,
)

pytestmark = [
    pytest.mark.usefixtures("ray_start_4_cpus"),
    pytest.mark.skipif(not get_spec("deepspeed").installed, reason="deepspeed is not installed"),
]

HIDDEN = 256  # wide enough that partitioning, not padding, decides the state size
TOLERANCE = {1: 1e-5, 2: 1e-5, 3: 1e-4}


def wide_model_creator(config: dict) -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(16, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 4),
    )


def adam_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 1e-3))


ADAM = {
    "model_creator": wide_model_creator,
    "data_creator": parity_data_creator,
    "optimizer_creator": adam_creator,
    "loss_creator": torch.nn.CrossEntropyLoss,
    "config": {"lr": 2e-3, "batch_size": 32},  # 512 samples: 16 steps per epoch
}


def optimizer_state_bytes(operator) -> int:
    """Bytes of the tensors in this rank's optimizer state (ZeRO: the local partition)."""
    optimizer = operator.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    return sum(
        value.numel() * value.element_size()
        for entry in inner.state.values()
        for value in entry.values()
        if torch.is_tensor(value)
    )


@pytest.fixture(scope="module")
def ddp_reference(ray_start_4_cpus, tmp_path_factory):
    """Two DDP workers with Adam: the run every ZeRO stage must reproduce."""
    path = tmp_path_factory.mktemp("ddp") / "ddp.pt"
    trainer = TorchTrainer(**ADAM, num_workers=2, backend="ddp")
    try:
        trainer.train()
        trainer.train()
        model = trainer.get_model()
        state_bytes = trainer.apply_all_operators(optimizer_state_bytes)
        trainer.save(path)
        trainer.train()
        continued = trainer.get_model()
    finally:
        trainer.shutdown()
    return {"model": model, "bytes": state_bytes, "path": path, "continued": continued}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_adam_parity_memory_and_checkpoints(stage, ddp_reference, tmp_path):
    tol = TOLERANCE[stage]
    trainer = TorchTrainer(
        **ADAM, num_workers=2, backend="deepspeed", backend_config={"stage": stage}
    )
    try:
        trainer.train()
        trainer.train()
        model = trainer.get_model()
        state_bytes = trainer.apply_all_operators(optimizer_state_bytes)
        val = trainer.validate()["val_loss"]
        path = trainer.save(tmp_path / f"zero{stage}.pt")

        # a DDP checkpoint (weights and Adam state) loads here and training continues
        trainer.load(ddp_reference["path"])
        trainer.train()
        continued_here = trainer.get_model()
    finally:
        trainer.shutdown()

    assert type(model) is torch.nn.Sequential
    assert max_param_diff(model, ddp_reference["model"]) <= tol

    ratios = [b / ref for b, ref in zip(state_bytes, ddp_reference["bytes"], strict=True)]
    assert all(r <= 0.55 for r in ratios), (stage, state_bytes, ddp_reference["bytes"], ratios)

    assert max_param_diff(continued_here, ddp_reference["continued"]) <= tol

    # the ZeRO checkpoint loads under DDP with one worker: same loss, and Adam resumes
    single = TorchTrainer(**ADAM, num_workers=1, backend="ddp")
    try:
        single.load(path)
        assert abs(single.validate()["val_loss"] - val) <= 1e-5
        single.train()
        assert max_param_diff(single.get_model(), ddp_reference["continued"]) <= tol
    finally:
        single.shutdown()


def test_gradient_accumulation_matches_the_larger_batch():
    """Local mode, 2 micro-batches of 16 per step == plain steps on batches of 32."""

    def run(backend, backend_config, batch_size, steps):
        trainer = TorchTrainer(
            model_creator=parity_model_creator,
            data_creator=parity_data_creator,
            optimizer_creator=parity_optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"lr": 0.1, "batch_size": batch_size},
            num_workers=0,
            backend=backend,
            backend_config=backend_config,
        )
        try:
            trainer.train(num_steps=steps)
            return trainer.get_model()
        finally:
            trainer.shutdown()

    accumulated = run("deepspeed", {"stage": 2, "gradient_accumulation_steps": 2}, 16, 24)
    reference = run("ddp", None, 32, 12)
    assert max_param_diff(accumulated, reference) <= 1e-5
    untouched = parity_model_creator({})
    assert max_param_diff(accumulated, untouched) > 1e-3  # it did train


def test_bf16_on_cpu_trains_in_local_mode():
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 32},
        num_workers=0,
        use_fp16=True,
        backend="deepspeed",
        backend_config={"stage": 1},
    )
    try:
        first = trainer.train(num_steps=20)
        second = trainer.train(num_steps=20)
        engine = trainer.apply_all_operators(lambda op: op.model)[0]
        assert engine.torch_autocast_enabled()
        assert engine.torch_autocast_dtype() == torch.bfloat16
        assert second["loss"] < first["loss"]
        weights = trainer.get_model().state_dict()
        assert all(v.dtype == torch.float32 for v in weights.values())
    finally:
        trainer.shutdown()


def test_ds_config_file_sets_the_stage(tmp_path):
    import json

    from polytrain.backends.deepspeed.backend import DeepSpeedBackend

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}))
    backend = DeepSpeedBackend({"config": str(path)})
    assert backend.config.zero_stage == 3
    assert backend.config.resolved()["gradient_clipping"] == 1.0
    backend.validate_settings(num_workers=2, use_gpu=False, use_fp16=False)


@pytest.mark.parametrize(
    ("backend_config", "use_gpu", "error", "match"),
    [
        ({"stage": 5}, False, ConfigError, r"stage 5 is not supported.*\[0, 1, 2, 3\]"),
        (
            {"stage": 2, "zero_stage": 2},
            False,
            TypeError,
            r"Unknown backend_config key.*zero_stage",
        ),
        (
            {"config": {"zero_optimization": {"stage": 2, "bucket_sise": 10}}},
            False,
            ConfigError,
            r"DeepSpeed rejected the config.*bucket_sise",
        ),
        ({"offload_optimizer": True}, False, ConfigError, r"offload_optimizer.*use_gpu=True"),
        (
            {"config": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}},
            False,
            ConfigError,
            r"offload_param.*use_gpu=True",
        ),
        (
            {"stage": 2, "offload_param": True},
            False,
            ConfigError,
            r"offload_param needs ZeRO stage 3",
        ),
        (
            {"config": {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}},
            False,
            ConfigError,
            r"'optimizer' section.*optimizer_creator",
        ),
        (
            {"stage": 1, "config": {"zero_optimization": {"stage": 3}}},
            False,
            ConfigError,
            r"stage=1 disagrees.*zero_optimization.stage=3",
        ),
        ({"config": "/no/such/ds_config.json"}, False, ConfigError, r"does not exist"),
    ],
    ids=[
        "stage-5",
        "unknown-key",
        "unknown-zero-key",
        "offload-optimizer-cpu",
        "offload-param-cpu",
        "offload-param-stage-2",
        "optimizer-section",
        "stage-conflict",
        "missing-file",
    ],
)
def test_config_errors_at_construction(backend_config, use_gpu, error, match, no_leftover_actors):
    with pytest.raises(error, match=match):
        TorchTrainer(
            **DIGITS,
            config={"batch_size": 32},
            num_workers=2,
            use_gpu=use_gpu,
            backend="deepspeed",
            backend_config=backend_config,
        )


@pytest.mark.parametrize("stage", [1, 3])
def test_ddp_checkpoint_loads_into_a_fresh_engine(stage, tmp_path):
    """Local mode: Adam state from DDP is created in an engine that never stepped."""
    local = {**ADAM, "model_creator": parity_model_creator, "num_workers": 0}
    reference = TorchTrainer(**local, backend="ddp")
    try:
        reference.train(num_steps=8)
        path = reference.save(tmp_path / "ddp.pt")
        reference.train(num_steps=8)
        expected = reference.get_model()
    finally:
        reference.shutdown()
    fresh = TorchTrainer(**local, backend="deepspeed", backend_config={"stage": stage})
    try:
        fresh.load(path)
        fresh.train(num_steps=8)
        assert max_param_diff(fresh.get_model(), expected) <= TOLERANCE[stage]
    finally:
        fresh.shutdown()


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_afterwards():
    """DeepSpeed's autotuner imports mlflow at import time (1.8 s); polytrain's import skips it."""
    code = (
        "import sys\n"
        "from polytrain.backends.deepspeed.env import import_deepspeed\n"
        "import_deepspeed()\n"
        "assert 'deepspeed' in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
        "from deepspeed.autotuning import autotuner\n"
        "assert autotuner.has_mlflow is False\n"
        "import mlflow\n"
        "print('ok', mlflow.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok mlflow")
