"""Reading HF checkpoint directories range by range, and building pretrained models without their weights.

No Ray: the reader against ``transformers``' own ``save_pretrained`` output
(sharded and not), the structure-only builds a backend asks for, and the errors
of bad input (a directory without weights, an incomplete one, a checkpoint that
lacks some of the model's parameters, a quantized base on CPU).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from polytrain.errors import CheckpointError, ConfigError  # noqa: E402
from polytrain.hf import loading  # noqa: E402
from polytrain.hf.weights import SafetensorsDir, file_backed  # noqa: E402

VOCAB = 96


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=24, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A GPT-2 saved twice: in one file and in shards of ~20 KB."""
    model = gpt2()
    one, shards = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("shards")
    model.save_pretrained(one)
    model.save_pretrained(shards, max_shard_size="20KB")
    return model, one, shards


def test_reads_any_range_of_any_tensor_in_one_file_or_shards(saved):
    model, one, shards = saved
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    expected = model.state_dict()
    for path in (one, shards):
        weights = SafetensorsDir(path)
        assert "lm_head.weight" not in weights  # the tied duplicate: HF writes it once
        for key in weights.keys():
            full = expected[key].reshape(-1)
            assert torch.equal(weights.read(key), full)
            assert weights.shape(key) == tuple(expected[key].shape)
            for start, numel in ((0, 1), (5, 31), (len(full) - 7, 7)):
                if start >= 0 and start + numel <= len(full):
                    assert torch.equal(weights.read(key, start, numel), full[start : start + numel])
        with pytest.raises(CheckpointError, match="outside tensor"):
            weights.read("transformer.wte.weight", 10, 10**9)


def test_directories_without_weights_are_refused_naming_what_they_hold(tmp_path, saved):
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        SafetensorsDir(tmp_path / "nowhere")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    (tmp_path / "bin" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds no safetensors weights.*\.bin weights"):
        SafetensorsDir(tmp_path / "bin")
    _, _, shards = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors.index.json").write_text(
        (shards / "model.safetensors.index.json").read_text()
    )
    with pytest.raises(CheckpointError, match="not in the directory; the checkpoint is incomplete"):
        SafetensorsDir(broken)


def test_an_empty_build_allocates_parameters_keeps_ties_and_buffers_and_marks_the_files(saved):
    """What rank 0 of a sharded backend builds: no weight read, the creator's own parts real."""
    model, one, _ = saved
    with loading.building("empty"):
        built = loading.from_pretrained(one)
    assert built.lm_head.weight is built.transformer.wte.weight
    assert {p.device.type for p in built.parameters()} == {"cpu"}
    backed = file_backed(built)
    assert set(backed) == {n for n, _ in built.named_parameters(remove_duplicate=False)}
    assert backed["lm_head.weight"][1] == "transformer.wte.weight"  # read through the kept name
    assert not built.training  # eval, as from_pretrained returns it
    reference = transformers.AutoModelForCausalLM.from_pretrained(one)
    assert built.config.to_dict() == reference.config.to_dict()


def test_peft_wraps_an_empty_build_and_its_names_still_find_the_files(saved):
    peft = pytest.importorskip("peft")
    _, one, _ = saved
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0)
    torch.manual_seed(4)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(one), lora)
    torch.manual_seed(4)
    with loading.building("empty"):
        built = peft.get_peft_model(loading.from_pretrained(one), lora)
    backed = file_backed(built)
    adapters = [n for n, _ in built.named_parameters() if "lora_" in n]
    assert adapters and not set(adapters) & set(backed)
    assert backed["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"][1] == (
        "transformer.h.0.attn.c_attn.weight"
    )
    expected = reference.state_dict()
    for name in adapters:  # the creator's random numbers: as after a full from_pretrained
        assert torch.equal(built.state_dict()[name], expected[name]), name


def test_transformers_from_pretrained_builds_the_structure_only_on_a_discarded_build(saved):
    """Under the meta device transformers refuses from_pretrained; here it builds the shapes."""
    _, one, _ = saved
    with pytest.raises(RuntimeError, match="meta device context manager"), torch.device("meta"):
        transformers.AutoModelForCausalLM.from_pretrained(one)
    with torch.device("meta"), loading.building("meta"):
        built = transformers.AutoModelForCausalLM.from_pretrained(one)
    assert {p.device.type for p in built.parameters()} == {"meta"}
    assert file_backed(built) == {}  # not marked: rank 0's weights replace it
    original = sys.modules["transformers.modeling_utils"].PreTrainedModel.__dict__[
        "from_pretrained"
    ]
    assert original.__func__.__module__ == "transformers.modeling_utils"  # restored


def test_a_checkpoint_missing_parameters_is_refused_in_a_build(tmp_path, saved):
    model, _, _ = saved
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("transformer.h.1.")}
    partial = transformers.GPT2LMHeadModel(model.config)
    partial.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(CheckpointError, match=r"lacks \d+ parameter\(s\) of GPT2LMHeadModel"):
        with loading.building("empty"):
            loading.from_pretrained(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only workers")
def test_a_quantized_base_is_refused_on_cpu_with_the_reason(saved):
    _, one, _ = saved
    with pytest.raises(ConfigError, match="needs a CUDA GPU: bitsandbytes"):
        loading.from_pretrained(one, load_in_4bit=True)


def test_ranges_of_every_dtype_read_bit_for_bit(tmp_path):
    """bf16, fp16, int64, bool and 0-d ranges, read by offset, equal the saved tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 11, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (13,), generator=g),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = SafetensorsDir(tmp_path)
    for key, tensor in tensors.items():
        flat = tensor.reshape(-1)
        for start, numel in ((0, None), (1, flat.numel() - 2), (flat.numel() - 1, 1)):
            if numel is not None and numel < 0:
                continue
            got = weights.read(key, start, numel)
            want = flat[start : start + numel] if numel is not None else flat
            assert got.dtype == tensor.dtype and torch.equal(got, want), (key, start, numel)
