"""Weights users can take away: ``save_pretrained`` and ``convert --to safetensors`` (issue 26, item 3).

A tiny GPT-2 (2 layers, d=32, vocabulary 128) trains a few steps on real Ray
actors under ddp, fsdp (FSDP2, 2 workers) and DeepSpeed ZeRO-3; the workers
write it in the Hugging Face layout, and ``transformers`` loads it back in this
process with the logits of ``trainer.get_model()`` and ``lm_head.weight`` tied to
``transformer.wte.weight`` again. A plain ``nn.Module`` (the digits MLP) round-trips
through ``safetensors.torch.load_file`` / ``load_model``; ``polytrain checkpoint
convert --to safetensors`` writes the same offline from the checkpoint
directories the sharded backends wrote and from a consolidated file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain import TorchTrainer
from polytrain.backends.registry import get_spec
from polytrain.compat.imports import module_available
from polytrain.errors import CheckpointError
from tests.helpers import DIGITS

pytestmark = [
    pytest.mark.usefixtures("ray_start_4_cpus"),
    pytest.mark.skipif(
        not (module_available("transformers") and module_available("safetensors")),
        reason='transformers and safetensors are not installed (pip install "polytrain[hf]")',
    ),
]

VOCAB, SEQ = 128, 16
TOLERANCE = 1e-6


def gpt2_creator(config: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    )


def tokens_creator(config: dict):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=generator)
    return DataLoader(TensorDataset(ids, ids), batch_size=config["batch_size"])


def adam_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


class NextTokenLoss:
    """Cross-entropy of the logits against the next token (the batch is ``(ids, ids)``)."""

    def __call__(self, output, labels):
        logits = output.logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )


def loss_creator(config: dict):
    return NextTokenLoss()


GPT2 = {
    "model_creator": gpt2_creator,
    "data_creator": tokens_creator,
    "optimizer_creator": adam_creator,
    "loss_creator": loss_creator,
    "config": {"batch_size": 16},
}


def _assert_same_model(path, reference: torch.nn.Module) -> None:
    """``from_pretrained(path)`` gives ``reference``'s logits, with the embedding tie intact."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    reference.eval()
    with torch.no_grad():
        diff = (loaded(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def _assert_tied_in_checkpoint(checkpoint: str) -> None:
    """Training kept the tie: the checkpoint's two names hold the same values."""
    from polytrain.checkpoint.directory import DirReader
    from polytrain.checkpoint.layout import open_checkpoint

    with DirReader(open_checkpoint(checkpoint)) as reader:
        head = reader.read(("models", 0, "lm_head.weight"))
        assert torch.equal(head, reader.read(("models", 0, "transformer.wte.weight")))


def _tensors_of(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    found: dict[str, torch.Tensor] = {}
    for name in files:
        found.update(load_file(os.path.join(path, name)))
    return found


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polytrain", "checkpoint", "convert", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _train(trainer: TorchTrainer, steps: int = 3) -> None:
    trainer.train(num_steps=steps, end_epoch=True)


@pytest.mark.usefixtures("no_leftover_actors")
def test_gpt2_under_ddp_exports_like_transformers(tmp_path):
    """One file and HF's config files; the consolidated file converts offline to the same."""
    trainer = TorchTrainer(**GPT2, num_workers=2, backend="ddp")
    try:
        _train(trainer)
        result = trainer.save_pretrained(tmp_path / "out")
        model = trainer.get_model()
        trainer.save(tmp_path / "ckpt.pt")
    finally:
        trainer.shutdown()
    assert result["files"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path / "out")) == result["files"]
    _assert_same_model(tmp_path / "out", model)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in handle.keys()  # the tied duplicate, as HF drops it
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert config["dtype"] == "float32"

    done = _convert("--to", "safetensors", str(tmp_path / "ckpt.pt"), str(tmp_path / "from_file"))
    assert done.returncode == 0, done.stderr
    _assert_same_model(tmp_path / "from_file", model)


@pytest.mark.usefixtures("no_leftover_actors")
def test_gpt2_under_fsdp2_writes_shards_and_converts_its_directory(tmp_path):
    """FSDP2 (2 workers): tiny shards with HF's index; its checkpoint directory converts offline."""
    trainer = TorchTrainer(
        **GPT2,
        num_workers=2,
        backend="fsdp",
        checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt")},
    )
    try:
        stats = trainer.train(num_steps=3, end_epoch=True)
        result = trainer.save_pretrained(tmp_path / "out", max_shard_size="40KB")
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    shards = [f for f in result["files"] if f.startswith("model-")]
    assert result["sharded"] and len(shards) >= 3
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]
    tensors = _tensors_of(tmp_path / "out")
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in model.parameters())
    _assert_same_model(tmp_path / "out", model)
    _assert_tied_in_checkpoint(stats["checkpoint_path"])

    done = _convert(
        "--to", "safetensors", stats["checkpoint_path"], str(tmp_path / "offline"),
        "--max-shard-size", "40KB",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "offline")) == result["files"]
    _assert_same_model(tmp_path / "offline", model)


@pytest.mark.skipif(not get_spec("deepspeed").installed, reason="deepspeed is not installed")
@pytest.mark.usefixtures("no_leftover_actors")
def test_gpt2_under_zero3_keeps_the_tie(tmp_path):
    """ZeRO-3 partitions the tied embedding once; the export holds it once and re-ties."""
    trainer = TorchTrainer(
        **GPT2,
        num_workers=2,
        backend="deepspeed",
        backend_config={"stage": 3},
        checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt")},
    )
    try:
        stats = trainer.train(num_steps=3, end_epoch=True)
        result = trainer.save_pretrained(tmp_path / "out")
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert "model.safetensors" in result["files"]
    _assert_same_model(tmp_path / "out", model)
    _assert_tied_in_checkpoint(stats["checkpoint_path"])
    done = _convert("--to", "safetensors", stats["checkpoint_path"], str(tmp_path / "offline"))
    assert done.returncode == 0, done.stderr
    _assert_same_model(tmp_path / "offline", model)


@pytest.mark.usefixtures("no_leftover_actors")
def test_plain_module_round_trips_and_a_used_path_is_refused(tmp_path):
    """The digits MLP under FSDP2: state-dict keys in model.safetensors, load_model restores it."""
    from safetensors.torch import load_model

    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    trainer = TorchTrainer(
        **DIGITS,
        config={"lr": 0.1, "batch_size": 64},
        num_workers=2,
        backend="fsdp",
        checkpoint_config={"checkpoint_dir": str(tmp_path / "ckpt")},
    )
    try:
        stats = trainer.train(num_steps=2, end_epoch=True)
        with pytest.raises(CheckpointError, match="exists and is not empty") as err:
            trainer.save_pretrained(used)
        assert str(used) in str(err.value)
        with pytest.raises(CheckpointError, match="model_index=3 is out of range"):
            trainer.save_pretrained(tmp_path / "third", model_index=3)  # refused on rank 0
        (tmp_path / "empty").mkdir()
        result = trainer.save_pretrained(tmp_path / "empty")
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    assert os.listdir(used) == ["keep.txt"]
    assert not (tmp_path / "third").exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]
    assert result["files"] == ["model.safetensors"]
    expected = model.state_dict()
    tensors = _tensors_of(tmp_path / "empty")
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    fresh = DIGITS["model_creator"]({})
    load_model(fresh, str(tmp_path / "empty" / "model.safetensors"))
    assert all(torch.equal(fresh.state_dict()[k], expected[k]) for k in expected)

    done = _convert("--to", "safetensors", stats["checkpoint_path"], str(used))
    assert done.returncode != 0 and "exists and is not empty" in done.stderr
    assert str(used) in done.stderr
    done = _convert("--to", "safetensors", stats["checkpoint_path"], str(tmp_path / "offline"))
    assert done.returncode == 0, done.stderr
    offline = _tensors_of(tmp_path / "offline")
    assert all(torch.equal(offline[k], expected[k]) for k in expected)
