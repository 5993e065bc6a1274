"""``parallelism=`` / ``tp_plan=`` as options: what each backend accepts, bad input, run configs (no Ray).

Every refusal here happens when the trainer is built, before a worker starts; the
ones that need the model (no plan for it, heads not divisible by tp) are the
plan's own checks, run here on the models themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polytrain import TorchTrainer
from polytrain.backends.registry import get_backend_class, get_spec
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.run_config import load_config
from tests.helpers import parity_data_creator, parity_model_creator, parity_optimizer_creator


def _trainer(backend: str, parallelism, num_workers: int = 4, **kwargs) -> TorchTrainer:
    return TorchTrainer(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        optimizer_creator=parity_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": 32},
        num_workers=num_workers,
        backend=backend,
        parallelism=parallelism,
        **kwargs,
    )


def test_a_product_that_does_not_match_the_workers_is_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"dp_replicate \* dp_shard \* tp = 8, but num_workers=4"):
        _trainer("fsdp", {"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    with pytest.raises(ConfigError, match="cannot shrink: drop scaling min_workers=2"):
        _trainer("fsdp", {"tp": 2}, None, scaling_config={"num_workers": 4, "min_workers": 2})


@pytest.mark.parametrize("backend", ["ddp", "horovod", "fairscale"])
def test_data_parallel_backends_refuse_a_mesh_and_name_the_backends_that_run_one(backend):
    if not get_spec(backend).installed:
        pytest.skip(f"{backend} is not installed")
    with pytest.raises(
        ConfigError, match=rf"not supported by the {backend} backend.*backend='fsdp'"
    ):
        _trainer(backend, {"dp_replicate": 2, "dp_shard": 2})
    with pytest.raises(ConfigError, match=rf"not supported by the {backend} backend"):
        _trainer(backend, {"tp": 2})
    # A 1-D data-parallel layout is what they do already.
    instance = get_backend_class(backend)()
    instance.configure_parallelism({"dp_replicate": -1}, num_workers=4)
    assert instance.data_parallel_size(4) == 4


def test_fsdp_takes_meshes_on_version_2_only_and_splits_the_batch_over_data_parallel_ranks():
    fsdp = get_backend_class("fsdp")()
    fsdp.configure_parallelism({"dp_shard": 2, "tp": 2}, num_workers=4)
    assert fsdp.parallelism.shape == (1, 2, 2)
    assert fsdp.data_parallel_size(4) == 2  # TP peers read the same batches
    assert type(fsdp.make_strategy()).__name__ == "MeshFSDPStrategy"
    fsdp.configure_parallelism({"dp_shard": -1}, num_workers=4)  # plain FSDP again
    assert type(fsdp.make_strategy()).__name__ == "FSDP2Strategy"
    with pytest.raises(ConfigError, match="version 1 .* has no device mesh"):
        _trainer("fsdp", {"dp_replicate": 2}, backend_config={"version": 1})


def test_tp_plan_is_checked_on_the_driver():
    with pytest.raises(ConfigError, match="'sideways' is not a known style"):
        _trainer("fsdp", {"tp": 2}, tp_plan={"layers.*.q": "sideways"})
    with pytest.raises(ConfigTypeError, match="must be a style name or a torch ParallelStyle"):
        _trainer("fsdp", {"tp": 2}, tp_plan={"layers.*.q": 3})
    with pytest.raises(ConfigError, match="has tp=1"):
        _trainer("fsdp", {"dp_shard": 4}, tp_plan={"0": "colwise"})


def test_a_model_without_a_plan_or_with_heads_not_divisible_by_tp_is_refused():
    transformers = pytest.importorskip("transformers")
    from polytrain.backends.fsdp.tp_plans import plan_name

    with pytest.raises(
        ConfigError, match=r"tp=2 needs a tensor-parallel plan for Sequential.*tp_plan="
    ):
        plan_name(parity_model_creator({}), None, 2)
    assert plan_name(parity_model_creator({}), {"0": "colwise"}, 2) == "tp_plan"
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=6, num_key_value_heads=3,
        )
    )  # fmt: skip
    assert plan_name(llama, None, 3) == "llama"
    with pytest.raises(ConfigError, match="num_key_value_heads=3, which is not divisible by 2"):
        plan_name(llama, None, 2)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=24, n_head=3, vocab_size=64, n_positions=16)
    )
    assert plan_name(gpt2, None, 3) == "gpt2"
    with pytest.raises(ConfigError, match="n_head=3, which is not divisible by 2"):
        plan_name(gpt2, None, 2)


def test_peft_adapters_under_tensor_parallelism_are_refused_with_what_to_use():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from polytrain.backends.core.parallelism import adapter_modules, refuse_adapters_under_tp

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        )
    )  # fmt: skip
    refuse_adapters_under_tp(llama, 2)  # a plain model: its plan splits it
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    adapted = peft.get_peft_model(llama, lora)
    assert adapter_modules(adapted)[0] == "<root>"  # the PeftModel itself
    refuse_adapters_under_tp(adapted, 1)  # data parallel: fine
    with pytest.raises(
        ConfigError, match=r"tp=2 cannot split a model with PEFT adapters.*dp_shard"
    ):
        refuse_adapters_under_tp(adapted, 2)
    # peft_config= on the trainer: refused on the driver, on both backends that run TP.
    for backend in ("fsdp", "deepspeed"):
        if not get_spec(backend).installed:
            continue
        with pytest.raises(ConfigError, match="tp=2 cannot split the adapters of peft_config="):
            _trainer(backend, {"tp": 2}, peft_config=lora)


def test_run_configs_carry_parallelism_and_tp_plan(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: examples.digits:model_creator\ndata: examples.digits:data_creator\n"
        "optimizer: examples.digits:optimizer_creator\nbackend: fsdp\nnum_workers: 4\n"
        "parallelism: {dp_shard: 2, tp: 2}\ntp_plan: {'0': colwise}\n"
    )
    run = load_config(path)
    kwargs = run.trainer_kwargs(TorchTrainer)
    assert kwargs["parallelism"] == {"dp_shard": 2, "tp": 2}
    assert kwargs["tp_plan"] == {"0": "colwise"}
    with pytest.raises(ConfigError, match=r"parallelism.*Unknown parallelism key\(s\) \['pp'\]"):
        load_config(path, ["parallelism.pp=2"])


def test_deepspeed_maps_tp_to_autotp_and_replication_to_hpz_and_refuses_the_rest():
    if not get_spec("deepspeed").installed:
        pytest.skip("deepspeed is not installed")
    deepspeed = get_backend_class("deepspeed")
    hpz = deepspeed({"stage": 3})
    hpz.configure_parallelism({"dp_replicate": 2, "dp_shard": 2}, num_workers=4)
    zero = hpz.make_strategy().config.resolved()["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2
    tp = deepspeed()
    tp.configure_parallelism({"dp_shard": 2, "tp": 2}, num_workers=4)
    strategy = tp.make_strategy()
    assert strategy.config.resolved()["tensor_parallel"] == {"autotp_size": 2}
    assert type(strategy).__name__ == "AutoTPStrategy" and tp.data_parallel_size(4) == 2
    with pytest.raises(ConfigError, match="hpZ.*needs ZeRO stage 3, but the config has stage 2"):
        _trainer("deepspeed", {"dp_replicate": 2, "dp_shard": 2})
    with pytest.raises(ConfigError, match="hpZ .* and AutoTP .* together are not supported"):
        _trainer("deepspeed", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8)
    with pytest.raises(ConfigError, match="tp_plan= is the fsdp backend's"):
        _trainer("deepspeed", {"tp": 2}, tp_plan={"0": "colwise"})
    conflicting = {"config": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}}
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2, but the DeepSpeed config"):
        _trainer("deepspeed", {"dp_replicate": 2, "dp_shard": 2}, backend_config=conflicting)


def test_checkpoint_rows_are_taken_as_they_are_only_where_each_block_is_whole_rows():
    """FSDP's row shards (also over a column-parallel TP weight) are written without moving
    data; a row-parallel weight (split by columns) or GPT-2's interleaved q/k/v is not."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from polytrain.backends.fsdp.state_mesh import _rows_already

    class Sizes:  # the mesh's dimension sizes, all _rows_already reads of it
        def size(self, dim: int) -> int:
            return 2

    mesh = Sizes()
    assert _rows_already((Shard(0), Shard(0)), mesh)
    assert _rows_already((_StridedShard(0, split_factor=2), Shard(0)), mesh)  # FSDP x colwise
    assert _rows_already((Shard(0), Replicate()), mesh)  # a norm under TP
    assert not _rows_already((Shard(0), Shard(1)), mesh)  # FSDP x rowwise
    assert not _rows_already((Shard(0), _StridedShard(1, split_factor=3)), mesh)  # c_attn
    assert not _rows_already(
        (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)), mesh
    )
