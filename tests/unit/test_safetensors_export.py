"""The HF-layout export format without Ray: tie rules, shard plan, sizes, refusals, atomicity."""

from __future__ import annotations

import os

import pytest
import torch

from polytrain.checkpoint import safetensors_export as export
from polytrain.compat.imports import module_available
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer_api.torch.model_info import export_info

pytestmark = pytest.mark.skipif(
    not (module_available("transformers") and module_available("safetensors")),
    reason='transformers and safetensors are not installed (pip install "polytrain[hf]")',
)


class Tied(torch.nn.Module):
    """A plain module whose ``b`` shares ``a``'s weight, plus a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("count", torch.tensor([3]))


def _write(model: torch.nn.Module, dst, max_shard_size="5GB") -> dict:
    tensors = export.ModelTensors.from_state(model.state_dict())
    return export.write_pretrained(tensors, export_info(model), dst, max_shard_size)


def test_plain_module_is_written_as_safetensors_save_model_writes_it(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_model, save_model

    model = Tied()
    assert export_info(model)["drop"] == {"b.weight": "a.weight"}
    assert export_info(model)["buffers"] == ["count"]
    _write(model, tmp_path / "ours")
    save_model(model, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours, theirs = (
        str(tmp_path / "ours" / export.WEIGHTS_NAME),
        str(tmp_path / "theirs.safetensors"),
    )
    with safe_open(ours, "pt") as mine, safe_open(theirs, "pt") as reference:
        assert mine.metadata() == reference.metadata() == {"format": "pt", "b.weight": "a.weight"}
        assert sorted(mine.keys()) == sorted(reference.keys())
        assert all(torch.equal(mine.get_tensor(k), reference.get_tensor(k)) for k in mine.keys())
    fresh = Tied()
    torch.nn.init.zeros_(fresh.a.weight)
    load_model(fresh, ours)
    assert fresh.b.weight is fresh.a.weight
    assert torch.equal(fresh.a.weight, model.a.weight)


def test_gpt2_matches_transformers_save_pretrained_file_for_file(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128))
    result = _write(model, tmp_path / "ours", max_shard_size="40KB")
    model.save_pretrained(tmp_path / "theirs", max_shard_size="40KB")
    assert result["files"] == sorted(os.listdir(tmp_path / "theirs"))
    assert len([f for f in result["files"] if f.startswith("model-")]) > 1
    for name in result["files"]:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1000, 1000), ("5GB", 5 * 10**9), ("200MB", 2 * 10**8), ("1GiB", 2**30), ("40kb", 40_000)],
)
def test_shard_sizes_read_as_hf_reads_them(value, expected):
    assert export.parse_max_shard_size(value) == expected


@pytest.mark.parametrize("value", [0, -5, "5 parsecs", "", True, 1.5])
def test_a_size_that_is_not_one_is_refused(value):
    with pytest.raises(ConfigError, match="max_shard_size"):
        export.parse_max_shard_size(value)


def test_a_used_or_remote_path_is_refused_before_writing(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        export.check_target(tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty") as err:
        _write(Tied(), tmp_path / "dir")
    assert str(tmp_path / "dir") in str(err.value)
    with pytest.raises(ConfigError, match="upload"):
        export.check_target("s3://bucket/model")
    (tmp_path / "empty").mkdir()
    assert export.check_target(tmp_path / "empty") == tmp_path / "empty"


def test_a_failed_export_leaves_nothing_that_looks_complete(tmp_path):
    model = Tied()
    tensors = export.ModelTensors.from_state(model.state_dict())
    reads = []

    def read(name):
        reads.append(name)
        if len(reads) > 1:
            raise OSError("disk full")
        return model.state_dict()[name]

    tensors.read = read
    with pytest.raises(OSError, match="disk full"):
        export.write_pretrained(tensors, export_info(model), tmp_path / "out", max_shard_size=70)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_without_export_info_writes_every_tensor(tmp_path):
    """Checkpoints written before the export info existed: no config, duplicates kept."""
    model = Tied()
    result = export.write_pretrained(
        export.ModelTensors.from_state(model.state_dict()), None, tmp_path / "out"
    )
    assert result["files"] == [export.WEIGHTS_NAME]
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "out" / export.WEIGHTS_NAME))) == set(model.state_dict())


def test_local_mode_exports_the_driver_process_model(tmp_path):
    """num_workers=0: the one worker is the driver process itself; the same files come out."""
    from safetensors.torch import load_file

    from polytrain import TorchTrainer
    from tests.helpers import DIGITS

    trainer = TorchTrainer(**DIGITS, config={"batch_size": 32}, num_workers=0)
    try:
        trainer.train(num_steps=2)
        result = trainer.save_pretrained(tmp_path / "out")
        expected = trainer.get_model().state_dict()
    finally:
        trainer.shutdown()
    assert result["files"] == [export.WEIGHTS_NAME]
    written = load_file(str(tmp_path / "out" / export.WEIGHTS_NAME))
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
