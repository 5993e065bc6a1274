"""Runs with frozen parameters in the driver process (``num_workers=0``, no Ray): LoRA's bookkeeping.

A LoRA run (``peft_config=`` on ``polytrain.hf.pretrained``) saves a consolidated
file without the frozen base, which loads into a fresh trainer and continues
exactly as the uninterrupted run (bit for bit); ``get_model()`` rebuilds the base
from the creator. The optimizer is rebuilt over the adapters only. Bad input is
refused with its reason: a model with nothing to train, a ``target_modules`` that
matches nothing, a ``peft_config`` of another type, an adapter save without
adapters, and an adapter checkpoint loaded into a run that trains the base.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from polytrain import TorchTrainer  # noqa: E402
from polytrain.errors import CheckpointError, ConfigError, ConfigTypeError  # noqa: E402
from polytrain.hf import pretrained  # noqa: E402

VOCAB, SEQ = 64, 8
LORA = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_attn"]}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> str:
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("base")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


def data_creator(config: dict):
    ids = torch.randint(0, VOCAB, (12, SEQ), generator=torch.Generator().manual_seed(2))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(rows, batch_size=config["batch_size"])


def adam_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=0.05)


def seeded(path: str):
    def creator(config: dict):
        torch.manual_seed(4)
        return pretrained(path)(config)

    return creator


def lora_trainer(path: str, **kwargs) -> TorchTrainer:
    options = {"peft_config": LORA, **kwargs}
    return TorchTrainer(
        model_creator=options.pop("model_creator", seeded(path)),
        data_creator=data_creator,
        optimizer_creator=adam_creator,
        config={"batch_size": 4},
        num_workers=0,
        **options,
    )


def lora_state(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in trainer.get_model().state_dict().items() if "lora_" in k}


def test_a_lora_file_holds_the_adapters_and_resumes_exactly(tmp_path, base_path):
    straight = lora_trainer(base_path)
    try:
        straight.train(num_steps=3)
        expected = lora_state(straight)
        params = straight.apply_all_operators(
            lambda op: [len(g["params"]) for g in op.optimizers[0].param_groups]
        )
    finally:
        straight.shutdown()
    assert params == [[len(expected)]]  # the optimizer steps the adapters only

    first = lora_trainer(base_path)
    try:
        first.train(num_steps=2)
        first.save(tmp_path / "lora.pt")
    finally:
        first.shutdown()
    saved = torch.load(tmp_path / "lora.pt", weights_only=True)
    model_keys = set(saved["models"][0])
    assert model_keys and all("lora_" in k for k in model_keys)  # the base is not in it
    (entry,) = saved["frozen"]
    assert entry["base"] == base_path and "base_model.model.lm_head.weight" in entry["names"]

    second = lora_trainer(base_path)
    try:
        second.load(tmp_path / "lora.pt")
        second.train(num_steps=1)
        resumed = lora_state(second)
        model = second.get_model()
    finally:
        second.shutdown()
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)  # bit for bit
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path).state_dict()
    assert torch.equal(
        model.base_model.model.transformer.wte.weight, base["transformer.wte.weight"]
    )


def test_an_adapter_checkpoint_is_refused_by_a_run_that_trains_the_base(tmp_path, base_path):
    first = lora_trainer(base_path)
    try:
        first.save(tmp_path / "lora.pt")
    finally:
        first.shutdown()

    def peft_unfrozen(config: dict):
        model = peft.get_peft_model(pretrained(base_path)(config), peft.get_peft_config(LORA))
        for param in model.parameters():
            param.requires_grad_(True)
        return model

    full = lora_trainer(base_path, model_creator=peft_unfrozen, peft_config=None)
    try:
        with pytest.raises(
            CheckpointError, match=r"left out .* frozen parameter.*this model trains"
        ):
            full.load(tmp_path / "lora.pt")
    finally:
        full.shutdown()


def test_bad_input_is_refused_with_the_reason(tmp_path, base_path):
    with pytest.raises(
        ConfigError, match=r"target_modules=\['q_proj'\] matches no module .*c_attn"
    ):
        lora_trainer(base_path, peft_config={**LORA, "target_modules": ["q_proj"]})
    with pytest.raises(ConfigTypeError, match="peft_config must be a peft.PeftConfig"):
        lora_trainer(base_path, peft_config="lora")
    with pytest.raises(ConfigError, match="has no 'peft_type'"):
        lora_trainer(base_path, peft_config={"r": 2})

    def frozen(config: dict):
        model = pretrained(base_path)(config)
        model.requires_grad_(False)
        return model

    with pytest.raises(ConfigError, match=r"no trainable parameter: all \d+ parameters"):
        lora_trainer(base_path, model_creator=frozen, peft_config=None)

    plain = lora_trainer(base_path, peft_config=None)
    try:
        with pytest.raises(CheckpointError, match="this model has none"):
            plain.save_pretrained(tmp_path / "merged", merge=True)
    finally:
        plain.shutdown()
    assert not (tmp_path / "merged").exists()


def test_a_quantized_base_is_refused_on_a_cpu_worker(base_path):
    """What a bitsandbytes load sets on the model (no GPU here to load one for real)."""
    from polytrain.hf import adapters

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    adapters.check_quantized(model, "cpu")  # an unquantized base is fine
    model.is_loaded_in_4bit = True
    lora = peft.get_peft_model(model, peft.get_peft_config(LORA))
    with pytest.raises(ConfigError, match="quantized .* run on CUDA GPUs only"):
        adapters.check_quantized(lora, "cpu")
    adapters.check_quantized(lora, "cuda")
