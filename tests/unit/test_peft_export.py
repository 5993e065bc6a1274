"""A PEFT model out, without Ray: its adapter in PEFT's layout, or merged into its base in HF's.

The exports are written from a model's tensors and the export info its live
model records (as the workers and ``polytrain checkpoint convert`` do) and
loaded back by ``peft`` and ``transformers`` in this process: the adapter by
``PeftModel.from_pretrained(base, path)`` (and ``AutoModelForCausalLM``'s own PEFT
loading), the merged model by ``AutoModelForCausalLM.from_pretrained(path)``,
each with the logits of the trained PEFT model (merged: of ``merge_and_unload``).
GPT-2's ``Conv1D`` (``fan_in_fan_out``), Llama's ``Linear`` (with ``lora_bias``) and
``Embedding`` layers and ``modules_to_save`` are covered; what cannot be written
so that it loads right is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from polytrain.checkpoint.safetensors_export import ModelTensors, write_pretrained  # noqa: E402
from polytrain.errors import ConfigError  # noqa: E402
from polytrain.hf import export as hf_export  # noqa: E402
from polytrain.trainer_api.torch.model_info import export_info  # noqa: E402

VOCAB = 64


def gpt2_base() -> torch.nn.Module:
    torch.manual_seed(2)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama_base(bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        attention_bias=bias,
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


CASES = {
    "gpt2-conv1d": (gpt2_base, {"target_modules": ["c_attn", "c_proj"]}),
    "llama-linear-bias": (
        lambda: llama_base(bias=True),
        {"target_modules": ["q_proj", "v_proj"], "lora_bias": True},
    ),
    "llama-embedding-modules-to-save": (
        llama_base,
        {"target_modules": ["o_proj", "embed_tokens"], "modules_to_save": ["lm_head"]},
    ),
}


def trained_peft(base_path, case: str) -> torch.nn.Module:
    """A PEFT model on the saved base whose adapters are far from their (zero) start."""
    _, options = CASES[case]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, **options))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return model(input_ids=ids).logits


def tensors_and_info(model: torch.nn.Module, drop_frozen: bool = False):
    """What the workers write: every tensor (or only the trained ones) and the live model's info."""
    state = model.state_dict()
    if drop_frozen:  # a checkpoint of the run: the frozen base left out
        named = model.named_parameters(remove_duplicate=False)  # tied names too, as the workers
        frozen = {n for n, p in named if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return ModelTensors.from_state(state), export_info(model, strict=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_adapter_loads_in_peft_and_the_merged_model_in_transformers(tmp_path, case):
    build, _ = CASES[case]
    build().save_pretrained(tmp_path / "base")
    model = trained_peft(tmp_path / "base", case)
    tensors, info = tensors_and_info(model)
    written = hf_export.write_adapter(tensors, info["peft"], tmp_path / "adapter")
    assert written["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    expected = logits(model)

    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    if case == "gpt2-conv1d":  # transformers' own PEFT loading reads the same directory
        auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
        assert torch.allclose(logits(auto), expected, atol=1e-5)

    hf_export.write_merged(tensors, info, tmp_path / "merged", max_shard_size="20KB")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = trained_peft(tmp_path / "base", case).merge_and_unload()
    assert type(merged) is type(reference)
    assert merged.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.allclose(merged.state_dict()[key], value, atol=1e-6), key
    assert torch.allclose(logits(merged), expected, atol=1e-5)


def test_a_checkpoint_without_its_base_merges_with_the_base_read_from_its_directory(tmp_path):
    gpt2_base().save_pretrained(tmp_path / "base")
    model = trained_peft(tmp_path / "base", "gpt2-conv1d")
    tensors, info = tensors_and_info(model, drop_frozen=True)
    assert not any("base_layer" in name for name in tensors.names)
    assert info["peft"]["base"] == str(tmp_path / "base")  # what the adapter names
    hf_export.write_merged(tensors, info, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.lm_head.weight is merged.transformer.wte.weight  # the tie, written once
    assert torch.allclose(logits(merged), logits(model), atol=1e-5)


def test_what_would_load_wrongly_is_refused_with_the_reason(tmp_path):
    base = gpt2_base()

    class Wrapper(torch.nn.Module):  # carries an HF config but is no transformers model
        def __init__(self) -> None:
            super().__init__()
            self.inner = base
            self.config = base.config

    with pytest.raises(ConfigError, match="Wrapper is not a transformers model but carries"):
        export_info(Wrapper(), strict=True)
    assert export_info(Wrapper(), strict=False)["files"] == {}  # a checkpoint records none

    tensors, info = ModelTensors.from_state(base.state_dict()), export_info(base)
    with pytest.raises(ConfigError, match="writes a PEFT adapter, but this model has none"):
        hf_export.write_adapter(tensors, hf_export.peft_section(info, "--to peft"), tmp_path / "a")
    with pytest.raises(ConfigError, match="merge=True writes a PEFT adapter, but this model"):
        hf_export.write_merged(tensors, info, tmp_path / "m")

    base.save_pretrained(tmp_path / "base")
    dora = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
        peft.LoraConfig(r=2, target_modules=["c_attn"], use_dora=True),
    )
    tensors, info = tensors_and_info(dora)
    with pytest.raises(ConfigError, match="cannot be merged into its base: .*DoRA"):
        hf_export.write_merged(tensors, info, tmp_path / "dora")
    # its adapter is fine: PEFT loads DoRA adapters
    hf_export.write_adapter(tensors, info["peft"], tmp_path / "dora-adapter")
    assert not (tmp_path / "dora").exists()

    llama_base().save_pretrained(tmp_path / "llama")  # no attention biases
    no_bias = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama"),
        peft.LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True),
    )
    tensors, info = tensors_and_info(no_bias)
    with pytest.raises(ConfigError, match="lora_bias, but its base layer has no bias"):
        hf_export.write_merged(tensors, info, tmp_path / "no-bias")


def test_a_peft_model_is_never_written_as_a_plain_hf_model(tmp_path):
    gpt2_base().save_pretrained(tmp_path / "base")
    model = trained_peft(tmp_path / "base", "gpt2-conv1d")
    tensors, info = tensors_and_info(model)
    assert info["files"] == {}  # no config.json that names PeftModelForCausalLM
    result = write_pretrained(tensors, info, tmp_path / "raw")
    assert "config.json" not in result["files"]  # from_pretrained fails loudly, not silently
    with pytest.raises((OSError, ValueError), match="config.json"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "raw")
