"""Set-up without a full model per worker (issue 26, item 2), on real Ray workers and gloo.

Under fsdp (v2 and v1) and DeepSpeed ZeRO-3 only rank 0 runs ``model_creator`` for
real; rank 1 builds on the meta device (fsdp) or under ``deepspeed.zero.Init``
(ZeRO-3) and receives its shards. Proved here on a 2-layer GPT-2 (tied ``wte`` /
``lm_head``) whose creator also re-initialises its weights itself with random
values (custom initialisation): the weights after set-up equal, bit for bit, the
model the same creator builds in this process, rank 1 never held the full weights
(the creator records, on each rank, how many parameter elements had storage), the
tie holds on every rank, and training gives the same losses as with
``init_on_rank0=False`` (today's path: every rank builds the full model).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from polytrain import TorchTrainer  # noqa: E402
from polytrain.errors import CreatorError  # noqa: E402

VOCAB, SEQ_LEN, BATCH = 96, 8, 4
#: What each call of the creator saw, by trainer and rank: {tag: {rank: [{"meta": bool,
#: "stored": elements with storage, "full": the model's elements}, ...]}}.
BUILT: dict[str, dict[int, list[dict[str, object]]]] = {}


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _custom_init(module: torch.nn.Module) -> None:
    # Random values of the creator's own: a rank whose weights were not rank 0's differs.
    if isinstance(module, (torch.nn.Embedding, transformers.pytorch_utils.Conv1D)):
        torch.nn.init.normal_(module.weight, std=0.05)


def gpt2_creator(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(gpt2)
    model.apply(_custom_init)
    _record(model, config)
    return model


def _record(model: torch.nn.Module, config: dict) -> None:
    """What this call of the creator built, on this rank, under ``config["tag"]``."""
    params = list(model.parameters())
    BUILT.setdefault(config.get("tag"), {}).setdefault(_rank(), []).append(
        {
            "meta": all(p.device.type == "meta" for p in params),
            # storage the parameters hold now (ZeRO-3: each rank's partition lives elsewhere)
            "stored": sum(p.data.numel() for p in params if p.device.type != "meta"),
            "full": sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel for p in params),
        }
    )


def data_creator(config: dict):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ_LEN), generator=g)
    rows = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(rows, batch_size=config["batch_size"])


def adam_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


BACKENDS = [
    pytest.param("fsdp", {"version": 2}, id="fsdp2"),
    pytest.param("fsdp", {"version": 1}, id="fsdp1"),
    pytest.param("deepspeed", {"stage": 3}, id="zero3"),
]


def make_trainer(backend: str, backend_config: dict, **kwargs) -> TorchTrainer:
    return TorchTrainer(
        model_creator=kwargs.pop("model_creator", gpt2_creator),
        data_creator=data_creator,
        optimizer_creator=adam_creator,
        config={"batch_size": BATCH, "tag": kwargs.pop("tag", None)},
        num_workers=2,
        backend=backend,
        backend_config=backend_config,
        failure_config={"max_retries": 0},
        **kwargs,
    )


def _seen(operator) -> dict:
    from tests.integration import test_meta_init

    return dict(test_meta_init.BUILT)


def _tied(operator) -> bool:
    model = operator.models[0]
    inner = getattr(model, "module", model)  # FSDP1 and the DeepSpeed engine wrap it
    return inner.lm_head.weight is inner.transformer.wte.weight


def _train_losses(trainer: TorchTrainer) -> list[float]:
    return [trainer.train(num_steps=1)["loss"] for _ in range(2)]


@pytest.mark.parametrize(("backend", "backend_config"), BACKENDS)
def test_rank0_builds_the_weights_the_others_only_their_shards(
    ray_start_4_cpus, no_leftover_actors, backend, backend_config
):
    expected = gpt2_creator({}).state_dict()
    on, off = f"on {backend} {backend_config}", f"off {backend} {backend_config}"  # unique tags
    trainer = make_trainer(backend, backend_config, tag=on)
    try:
        weights = trainer.state_dict()["models"][0]
        seen = [s[on][rank] for rank, s in enumerate(trainer.apply_all_operators(_seen))]
        tied = trainer.apply_all_operators(_tied)
        losses = _train_losses(trainer)
    finally:
        trainer.shutdown()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name  # bit for bit, custom init included
    full = seen[0][0]["full"]
    assert seen[0][0] == {"meta": False, "stored": full, "full": full}  # rank 0: for real
    if backend == "fsdp":
        assert seen[1] == [{"meta": True, "stored": 0, "full": full}]  # rank 1: on meta
    else:  # ZeRO-3: every rank also builds under zero.Init, partitioned as it is built
        assert seen[0][1:] == seen[1] == [{"meta": False, "stored": 0, "full": full}]
    assert tied == [True, True]

    everywhere = make_trainer(backend, {**backend_config, "init_on_rank0": False}, tag=off)
    try:
        before = [s[off][rank] for rank, s in enumerate(everywhere.apply_all_operators(_seen))]
        assert _train_losses(everywhere) == losses  # today's path: the same run
    finally:
        everywhere.shutdown()
    assert before == [[{"meta": False, "stored": full, "full": full}]] * 2


def item_creator(config: dict) -> torch.nn.Module:
    model = torch.nn.Linear(4, 2)
    scale = float(model.weight.abs().max().item())  # reads a value: impossible on meta
    model.weight.data /= scale
    return model


def test_a_creator_that_cannot_run_on_meta_fails_naming_the_option(
    ray_start_4_cpus, no_leftover_actors
):
    with pytest.raises(CreatorError, match="model_creator failed on rank 1") as info:
        make_trainer("fsdp", {}, model_creator=item_creator)
    message = str(info.value)
    assert "meta" in message and '"init_on_rank0": False' in message


class Rotary(torch.nn.Module):
    """A non-persistent buffer (in no state dict) drawn at random, and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.randn(8), persistent=False)

    def forward(self, input_ids, labels):
        logits = self.head(self.block(self.embed(input_ids) * self.table))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def rotary_creator(config: dict) -> torch.nn.Module:
    torch.manual_seed(3)
    model = Rotary()
    _record(model, config)
    return model


def _table_and_tie(operator) -> tuple[list[float], bool]:
    model = operator.models[0]
    return model.table.tolist(), model.head.weight is model.embed.weight


def test_buffers_and_ties_come_from_rank0_and_resuming_overwrites_its_weights(
    ray_start_4_cpus, no_leftover_actors, tmp_path
):
    """The buffer, in no state dict, is uninitialised memory on rank 1 unless broadcast."""
    fresh = rotary_creator({})
    first = make_trainer(
        "fsdp",
        {},
        model_creator=rotary_creator,
        tag="first",
        checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt")},
    )
    try:
        assert first.apply_all_operators(_table_and_tie) == [(fresh.table.tolist(), True)] * 2
        path = first.train()["checkpoint_path"]
        expected = first.state_dict()["models"][0]
    finally:
        first.shutdown()
    resumed = make_trainer("fsdp", {}, model_creator=rotary_creator, tag="resumed")
    try:
        resumed.load(path)
        got = resumed.state_dict()["models"][0]
        seen = resumed.apply_all_operators(_seen)[1]["resumed"][1]
    finally:
        resumed.shutdown()
    assert seen[0]["meta"] is True  # rank 1 built on meta, then the checkpoint replaced rank 0's
    assert not torch.equal(expected["embed.weight"], fresh.embed.weight)  # it trained
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
