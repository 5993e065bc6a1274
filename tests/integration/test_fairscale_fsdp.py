"""The sharding backends, fairscale (OSS / ShardedDataParallel) and PyTorch FSDP, on CPU with gloo.

PyTorch FSDP runs in both versions: ``fully_shard`` (FSDP2, the default) and
``FullyShardedDataParallel`` (FSDP1, ``version=1``). Each is checked against 2-worker DDP: same parameters after training with Adam
(the optimizer whose state gets sharded), about half of DDP's optimizer state per
rank, and checkpoints that move both ways between them and ``ddp`` at another
world size, optimizer state included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer, TrainingOperator
from polytrain.backends.registry import get_spec
from tests.helpers import (
    DIGITS,
    max_param_diff,
    parity_data_creator,
    parity_model_creator,
)

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

needs_fairscale = pytest.mark.skipif(
    not get_spec("fairscale").installed, reason="fairscale is not installed"
)

# (backend, backend_config)
SHARDED = [
    pytest.param("fairscale", {"mode": "oss"}, id="fairscale-oss", marks=needs_fairscale),
    pytest.param("fairscale", {"mode": "sddp"}, id="fairscale-sddp", marks=needs_fairscale),
    pytest.param("fsdp", None, id="fsdp2"),
    pytest.param("fsdp", {"version": 1}, id="fsdp1"),
]


# ------------------------------------------------------------------ creators
def adam_two_groups_creator(model, config):
    """Adam with a per-group learning rate: the first layer learns at twice the default."""
    first, *rest = list(model.children())
    return torch.optim.Adam(
        [
            {"params": first.parameters(), "lr": 2 * config["lr"]},
            {"params": [p for m in rest for p in m.parameters()]},
        ],
        lr=config["lr"],
    )


def step_lr_creator(optimizer, config):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)


PARITY_ADAM = {
    "model_creator": parity_model_creator,
    "data_creator": parity_data_creator,
    "optimizer_creator": adam_two_groups_creator,
    "scheduler_creator": step_lr_creator,
    "loss_creator": torch.nn.CrossEntropyLoss,
    "config": {"lr": 0.01, "batch_size": 32},
}

WIDTH = 256


def wide_model_creator(config):
    """Four Linear(256, 256) layers: even-sized tensors, so partitions can balance."""
    torch.manual_seed(3)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def wide_data_creator(config):
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((128, WIDTH)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, WIDTH, 128))
    return DataLoader(TensorDataset(x, y), batch_size=config["batch_size"])


def adam_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


# ------------------------------------------------------------------- helpers
def optimizer_state_bytes(operator) -> int:
    """Bytes of the tensors this rank's optimizer state holds (OSS's inner shard included)."""
    seen = set()
    total = 0
    optimizers = [operator.optimizer, getattr(operator.optimizer, "optim", None)]
    for optimizer in filter(None, optimizers):
        for state in optimizer.state.values():
            for tensor in state.values():
                if not torch.is_tensor(tensor):
                    continue
                # FSDP2's state is DTensors: count this rank's local shard, not the global size
                tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                if tensor.numel() == 0:
                    continue
                key = (tensor.data_ptr(), tensor.numel())
                if key not in seen:
                    seen.add(key)
                    total += tensor.numel() * tensor.element_size()
    return total


def count_fsdp_units(operator) -> int:
    """FSDP1's wrapper modules, or the modules FSDP2's ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units = (FSDPModule, FullyShardedDataParallel)
    return sum(isinstance(m, units) for m in operator.model.modules())


def forward_dtype(operator) -> str:
    operator.model.eval()
    with torch.no_grad(), operator.autocast():
        return str(operator.model(torch.zeros(2, 64)).dtype)


def make_trainer(backend, backend_config, num_workers=2, **kwargs):
    spec = {**PARITY_ADAM, **kwargs}
    return TorchTrainer(
        **spec, num_workers=num_workers, backend=backend, backend_config=backend_config
    )


@pytest.fixture(scope="module")
def ddp_adam_reference(ray_start_4_cpus):
    """2-worker DDP with the two-group Adam and StepLR after two epochs (32 steps)."""
    trainer = make_trainer("ddp", None)
    try:
        trainer.train()
        trainer.train()
        return trainer.get_model()
    finally:
        trainer.shutdown()


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize(("backend", "backend_config"), SHARDED)
def test_adam_parity_with_ddp(backend, backend_config, ddp_adam_reference):
    """32 Adam steps with per-group lr and a StepLR schedule match DDP to 1e-5."""
    trainer = make_trainer(backend, backend_config)
    try:
        trainer.train()
        trainer.train()
        lrs = trainer.apply_all_operators(lambda op: [g["lr"] for g in op.optimizer.param_groups])
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    # 32 steps of StepLR(10, 0.5): the per-group rates survive the rebuild and follow the schedule
    assert lrs == [[0.02 * 0.125, 0.01 * 0.125]] * 2
    assert max_param_diff(model, ddp_adam_reference) <= 1e-5


@pytest.mark.parametrize(("backend", "backend_config"), SHARDED)
def test_optimizer_state_is_sharded(backend, backend_config):
    """With Adam on 2 workers each rank holds about half of DDP's optimizer state."""

    def per_rank_bytes(name, cfg):
        trainer = TorchTrainer(
            model_creator=wide_model_creator,
            data_creator=wide_data_creator,
            optimizer_creator=adam_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"batch_size": 32},
            num_workers=2,
            backend=name,
            backend_config=cfg,
        )
        try:
            trainer.train(num_steps=2)
            units = trainer.apply_all_operators(count_fsdp_units) if name == "fsdp" else None
            return trainer.apply_all_operators(optimizer_state_bytes), units
        finally:
            trainer.shutdown()

    if backend == "fsdp":
        # one FSDP unit per Linear layer, so only one layer is gathered at a time
        backend_config = {**(backend_config or {}), "min_num_params": 50_000}
    sharded, units = per_rank_bytes(backend, backend_config)
    replicated, _ = per_rank_bytes("ddp", None)
    full = replicated[0]
    assert full == 2 * 4 * sum(p.numel() for p in wide_model_creator({}).parameters()) + 4 * 8
    ratios = [b / full for b in sharded]
    print(f"{backend} {backend_config}: per-rank optimizer state / DDP's = {ratios}")
    assert max(ratios) <= 0.55, ratios
    # nothing lost: the shards add up to the whole state (FSDP pads each unit by < 2 elements)
    assert sum(sharded) >= 0.999 * full, (sharded, full)
    if units is not None:
        assert units == [5, 5], units  # four layers and the root


@pytest.mark.parametrize(("backend", "backend_config"), SHARDED)
def test_checkpoint_moves_to_ddp_at_another_world_size(backend, backend_config, tmp_path):
    """Save sharded on 2 workers, load under ddp on 1 (or 3): same loss; on 1 the same next steps."""
    ddp_workers = 3 if backend_config == {"mode": "oss"} else 1
    trainer = make_trainer(backend, backend_config)
    try:
        trainer.train()
        val = trainer.validate()["val_loss"]
        path = trainer.save(tmp_path / "sharded.pt")
        trainer.train()
        continued = trainer.get_model()
    finally:
        trainer.shutdown()

    # the optimizer state is in torch's format: a plain torch Adam of the same layout loads it
    checkpoint = torch.load(path, weights_only=True)
    plain = adam_two_groups_creator(parity_model_creator({}), {"lr": 0.01})
    plain.load_state_dict(checkpoint["optimizers"][0])
    assert sorted(plain.state_dict()["state"]) == [0, 1, 2, 3]
    assert [float(s["step"]) for s in plain.state_dict()["state"].values()] == [16.0] * 4
    assert [g["lr"] for g in plain.param_groups] == [0.02 * 0.5, 0.01 * 0.5]

    # 3 workers take 11 samples each (global batch 33); 1 worker the same global batch of 32
    config = {"lr": 0.01, "batch_size": 33 if ddp_workers == 3 else 32}
    other = make_trainer("ddp", None, num_workers=ddp_workers, config=config)
    try:
        other.load(path)
        assert abs(other.validate()["val_loss"] - val) <= 1e-5
        stats = other.train()
        if ddp_workers == 1:
            # Adam's moments and step counts came along: the next epoch matches
            assert max_param_diff(other.get_model(), continued) <= 1e-5
        else:
            assert stats["loss"] < val * 1.2
    finally:
        other.shutdown()


@pytest.mark.parametrize(("backend", "backend_config"), SHARDED)
def test_ddp_checkpoint_loads_sharded(backend, backend_config, tmp_path):
    """A ddp checkpoint loads here; each rank keeps only its shard; training continues exactly."""
    trainer = make_trainer("ddp", None)
    try:
        trainer.train()
        val = trainer.validate()["val_loss"]
        path = trainer.save(tmp_path / "ddp.pt")
        trainer.train()
        continued = trainer.get_model()
        full = trainer.apply_all_operators(optimizer_state_bytes)[0]
    finally:
        trainer.shutdown()

    sharded = make_trainer(backend, backend_config)
    try:
        sharded.load(path)
        assert abs(sharded.validate()["val_loss"] - val) <= 1e-5
        per_rank = sharded.apply_all_operators(optimizer_state_bytes)
        assert max(per_rank) < full and sum(per_rank) >= 0.999 * full, (per_rank, full)
        sharded.train()
        assert max_param_diff(sharded.get_model(), continued) <= 1e-5
    finally:
        sharded.shutdown()


class AccumulateTwo(TrainingOperator):
    """Two micro-batches per step; the first backward skips the gradient sync."""

    def train_batch(self, batch, batch_info):
        *features, target = batch
        half = target.shape[0] // 2
        self.zero_grad()
        with self.no_sync():
            loss = self.criterion(self.model(features[0][:half]), target[:half]) / 2
            self.backward(loss)
        loss2 = self.criterion(self.model(features[0][half:]), target[half:]) / 2
        self.backward(loss2)
        self.step()
        return {"loss": (loss + loss2).item(), "num_samples": target.shape[0]}


@pytest.mark.parametrize(("backend", "backend_config"), SHARDED[1:])
def test_no_sync_gradient_accumulation_matches_ddp(backend, backend_config):
    def run(name, cfg):
        trainer = make_trainer(name, cfg, training_operator_cls=AccumulateTwo)
        try:
            trainer.train()
            return trainer.get_model()
        finally:
            trainer.shutdown()

    assert max_param_diff(run(backend, backend_config), run("ddp", None)) <= 1e-5


@pytest.mark.parametrize(("backend", "backend_config"), SHARDED)
def test_mixed_precision_trains_on_cpu(backend, backend_config):
    """use_fp16 on CPU: bf16 autocast (fairscale), FSDP2's MixedPrecisionPolicy, FSDP1's MixedPrecision."""
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=2,
        backend=backend,
        backend_config=backend_config,
        use_fp16=True,
    )
    try:
        first = trainer.train()
        last = trainer.train()
        dtypes = trainer.apply_all_operators(forward_dtype)
        held = trainer.apply_all_operators(
            lambda op: [sharding_facts(op)[key] for key in ("kinds", "dtypes")]
        )
    finally:
        trainer.shutdown()
    assert last["loss"] < first["loss"]
    assert dtypes == ["torch.bfloat16"] * 2
    # bf16 compute (and, under FSDP, bf16 reduction); the parameters themselves stay fp32
    kind = "DTensor" if backend == "fsdp" and not backend_config else "Parameter"
    assert held == [[[kind], ["torch.float32"]]] * 2


@needs_fairscale
def test_fairscale_fsdp_mode_on_cpu_points_to_torch_fsdp(no_leftover_actors):
    with pytest.raises(ValueError, match=r"use_gpu=True.*backend='fsdp'"):
        TorchTrainer(**DIGITS, num_workers=2, backend="fairscale", backend_config={"mode": "fsdp"})


@needs_fairscale
def test_fairscale_unknown_mode_lists_the_allowed_ones(no_leftover_actors):
    with pytest.raises(ValueError, match=r"\('zero'\).*'oss', 'sddp', 'fsdp'"):
        TorchTrainer(**DIGITS, num_workers=2, backend="sharded", backend_config={"mode": "zero"})


def test_fsdp_unknown_options_are_rejected(no_leftover_actors):
    with pytest.raises(ValueError, match=r"\('hybrid'\).*'FULL_SHARD', 'SHARD_GRAD_OP'"):
        TorchTrainer(
            **DIGITS, num_workers=2, backend="fsdp", backend_config={"sharding_strategy": "hybrid"}
        )
    with pytest.raises(ValueError, match=r"\('transformers'\).*'size_based', 'none'"):
        TorchTrainer(
            **DIGITS,
            num_workers=2,
            backend="fsdp",
            backend_config={"auto_wrap_policy": "transformers"},
        )


def test_fsdp_version_is_validated(no_leftover_actors):
    """Only 1 and 2; FSDP1-only options under version 2 say how to get them."""
    with pytest.raises(ValueError, match=r"version \(3\) is not supported.*2 .*or 1 "):
        TorchTrainer(**DIGITS, num_workers=2, backend="fsdp", backend_config={"version": 3})
    with pytest.raises(ValueError, match=r"sharding_strategy='NO_SHARD'.*'version': 1"):
        TorchTrainer(
            **DIGITS,
            num_workers=2,
            backend="fsdp",
            backend_config={"sharding_strategy": "no_shard"},
        )


def sharding_facts(operator) -> dict:
    """How the model's parameters are held, and whether the optimizer holds those same objects."""
    params = list(operator.model.parameters())
    held = [p for group in operator.optimizer.param_groups for p in group["params"]]
    return {
        "kinds": sorted({type(p).__name__ for p in params}),
        "dtypes": sorted({str(p.dtype) for p in params}),
        "optimizer_holds_them": [id(p) for p in params] == [id(p) for p in held],
    }


@pytest.mark.parametrize(
    "backend_config",
    [
        {"sharding_strategy": "SHARD_GRAD_OP"},
        {"auto_wrap_policy": "none"},
        {"version": 1, "sharding_strategy": "SHARD_GRAD_OP"},
        {"version": 1, "auto_wrap_policy": "none"},
    ],
    ids=["fsdp2-shard-grad-op", "fsdp2-no-auto-wrap", "fsdp1-shard-grad-op", "fsdp1-no-auto-wrap"],
)
def test_fsdp_options_keep_parity(backend_config, ddp_adam_reference):
    trainer = make_trainer("fsdp", backend_config)
    try:
        trainer.train()
        trainer.train()
        facts = trainer.apply_all_operators(sharding_facts)
        # a forward without backward leaves SHARD_GRAD_OP's units gathered: state must still be right
        trainer.validate()
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert max_param_diff(model, ddp_adam_reference) <= 1e-5
    kind = "Parameter" if backend_config.get("version") == 1 else "DTensor"
    assert (
        facts == [{"kinds": [kind], "dtypes": ["torch.float32"], "optimizer_holds_them": True}] * 2
    )
