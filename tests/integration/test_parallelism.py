"""``parallelism=`` on the fsdp backend, proven equal to one process (issue 42).

Every run trains a tiny HF Llama or GPT-2 (tests/integration/parallel_models.py)
on the same global batches as :func:`~tests.integration.parallel_models.reference`
with the step options on: ``max_grad_norm`` (active at every step),
``gradient_accumulation_steps=2`` and a per-step schedule. The per-step losses and
gradient norms must match within 1e-4 relative. The reference is shown to move
far outside that tolerance without the clip or the accumulation; a TP plan that
splits a wrong dimension (q, k, v mixed up, a row-parallel layer split by rows)
changes the losses at once, a clip that misses the TP ranks or a mesh group
changes the norms, and a mesh whose TP peers read different data changes both.

Checkpoints cross layouts with identical state: fsdp over 4 workers -> TP 2 x FSDP
2 and TP 2 x FSDP 2 -> ddp on 1 worker; ``save_pretrained`` from the TP run writes
HF's layout. HSDP 2x2 runs on a simulated two-node cluster
(tests/integration/parallel_script.py) with replication across the nodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from polytrain import TorchTrainer  # noqa: E402
from tests.integration import parallel_models as lm  # noqa: E402
from tests.integration.fresh_cluster import run_script_on_fresh_cluster  # noqa: E402

SCRIPT = Path(__file__).with_name("parallel_script.py")

TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 2e-5
KEEP_WARM_POOL = False  # every test places its own 4 (or 2) workers


def make_trainer(model: str, parallelism, num_workers: int = 4, **kwargs) -> TorchTrainer:
    return TorchTrainer(
        model_creator=lm.CREATORS[model],
        data_creator=lm.data_creator,
        optimizer_creator=lm.sgd_creator,
        scheduler_creator=lm.scheduler_creator,
        config={"batch_size": lm.GLOBAL_BATCH, **kwargs.pop("config", {})},
        num_workers=num_workers,
        backend=kwargs.pop("backend", "fsdp"),
        parallelism=parallelism,
        max_grad_norm=lm.MAX_NORM,
        gradient_accumulation_steps=lm.ACCUMULATION,
        failure_config={"max_retries": 0},
        **kwargs,
    )


def train_steps(trainer: TorchTrainer) -> list[dict]:
    return [trainer.train(num_steps=1) for _ in range(lm.STEPS)]


def assert_matches_reference(
    stats: list[dict], trained: torch.nn.Module, model: str, layout: str = "", **config
) -> None:
    reference, losses, norms = lm.reference(model, config=config)
    got = [s["loss"] for s in stats]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, losses, strict=True))
    print(f"[parallelism] {model} {layout}: per-step loss max rel diff {worst:.1e}, weights "
          f"{max_diff(trained, reference):.1e}")  # fmt: skip
    assert [s["num_steps"] for s in stats] == [1] * lm.STEPS
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=TOLERANCE)
    assert [s["grad_norm"] for s in stats] == pytest.approx(norms, rel=TOLERANCE)
    assert max_diff(trained, reference) < WEIGHT_TOLERANCE
    # TP peers count their shared samples once.
    assert stats[0]["num_samples"] == lm.ACCUMULATION * lm.GLOBAL_BATCH


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_the_reference_is_sensitive_to_the_clip_and_the_accumulation(model):
    """Without this, equality below would not prove the clip and the accumulation."""
    reference, losses, norms = lm.reference(model)
    assert min(norms) > lm.MAX_NORM  # the clip acts at every step
    unclipped, unclipped_losses, _ = lm.reference(model, clip=False)
    assert unclipped_losses[1:] != pytest.approx(losses[1:], rel=TOLERANCE)
    assert max_diff(reference, unclipped) > 100 * WEIGHT_TOLERANCE
    assert max_diff(reference, lm.reference(model, accumulate=False)[0]) > 100 * WEIGHT_TOLERANCE


@pytest.fixture(scope="module")
def fsdp4_checkpoint(ray_start_4_cpus, tmp_path_factory):
    """A checkpoint directory written by plain fsdp on 4 workers (momentum in it), and its state."""
    folder = tmp_path_factory.mktemp("fsdp4")
    trainer = make_trainer("llama", None, checkpoint_config={"checkpoint_dir": str(folder)})
    try:
        path = trainer.train()["checkpoint_path"]
        state = trainer.state_dict()
    finally:
        trainer.shutdown()
    return path, state


def test_tp2_x_fsdp2_llama_equals_one_process_and_its_checkpoints_cross_layouts(
    ray_start_4_cpus, no_leftover_actors, fsdp4_checkpoint, tmp_path
):
    """TP 2 x FSDP 2 with clipping, accumulation and activation checkpointing; then checkpoints.

    fsdp 4 -> tp 2 x fsdp 2 and tp 2 x fsdp 2 -> ddp on 1 worker load with identical
    weights and optimizer state; ``save_pretrained`` writes what ``from_pretrained`` reads.
    """
    from tests.integration.test_checkpoint_dir import assert_same_state

    folder = tmp_path / "tp"
    trainer = make_trainer(
        "llama",
        {"dp_shard": 2, "tp": 2},
        activation_checkpointing=True,
        checkpoint_config={"checkpoint_dir": str(folder)},
    )
    try:
        stats = train_steps(trainer)  # the epoch's end writes a checkpoint directory
        trained = trainer.get_model()
        expected = trainer.state_dict()
        trainer.save_pretrained(tmp_path / "hf")
        fsdp_path, fsdp_state = fsdp4_checkpoint
        trainer.load(fsdp_path)  # fsdp 4 -> tp 2 x fsdp 2
        assert_same_state(fsdp_state, trainer.state_dict())
    finally:
        trainer.shutdown()
    assert_matches_reference(stats, trained, "llama", "fsdp tp2 x fsdp2")
    other = make_trainer("llama", None, num_workers=0, backend="ddp")
    try:
        other.load(str(folder / "checkpoint_000001"))  # tp 2 x fsdp 2 -> ddp, 1 worker
        assert_same_state(expected, other.state_dict())
    finally:
        other.shutdown()
    import transformers

    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key, value in expected["models"][0].items():
        assert torch.equal(exported[key], value), key


def test_tp2_x_fsdp2_gpt2_equals_one_process_and_its_state_round_trips(
    ray_start_4_cpus, no_leftover_actors, tmp_path
):
    """GPT-2's own plan (Conv1D, fused q/k/v) under TP 2 x FSDP 2, with activation checkpointing.

    Its consolidated state and its checkpoint directory load back unchanged: q, k and
    v are interleaved in each rank's block of ``c_attn``, which a load slicing by
    offsets would scramble, and the embeddings live on the data-parallel mesh only
    (each TP rank holds them: one must write them).
    """
    from tests.integration.test_checkpoint_dir import assert_same_state

    folder = tmp_path / "gpt2"
    trainer = make_trainer(
        "gpt2",
        {"dp_shard": 2, "tp": 2},
        activation_checkpointing=True,
        checkpoint_config={"checkpoint_dir": str(folder)},
    )
    try:
        stats = train_steps(trainer)  # the epoch's end writes a checkpoint directory
        trained = trainer.get_model()
        state = trainer.state_dict()
        trainer.load_state_dict(state)
        assert_same_state(state, trainer.state_dict())
        trainer.load(str(folder / "checkpoint_000001"))
        assert_same_state(state, trainer.state_dict())
    finally:
        trainer.shutdown()
    assert_matches_reference(stats, trained, "gpt2", "fsdp tp2 x fsdp2")


def test_a_users_tp_plan_splits_a_model_without_a_built_in_plan(
    ray_start_4_cpus, no_leftover_actors
):
    """``tp_plan=`` on a plain MLP (Linear, Tanh, Linear): column- then row-parallel, TP 2."""
    from tests.helpers import (
        max_param_diff,
        parity_data_creator,
        parity_model_creator,
        parity_optimizer_creator,
        plain_reference,
    )

    steps, global_batch = 4, 32
    trainer = TorchTrainer(
        model_creator=parity_model_creator,
        data_creator=parity_data_creator,
        optimizer_creator=parity_optimizer_creator,
        loss_creator=torch.nn.CrossEntropyLoss,
        config={"batch_size": global_batch},
        num_workers=2,
        backend="fsdp",
        parallelism={"tp": 2},
        tp_plan={"0": "colwise", "2": "rowwise"},
        failure_config={"max_retries": 0},
    )
    try:
        trainer.train(num_steps=steps)
        trained = trainer.get_model()
    finally:
        trainer.shutdown()
    assert max_param_diff(trained, plain_reference(steps, global_batch)) < WEIGHT_TOLERANCE


def tp_loop(config):
    """The function API: ``prepare(..., parallelism=)``, then a plain loop with the helpers."""
    from polytrain.train import report
    from polytrain.train import torch as train_torch

    model = lm.llama_creator({})
    optimizer = lm.sgd_creator(model, {})
    model, optimizer = train_torch.prepare(model, optimizer, parallelism={"tp": 2})
    scheduler = lm.scheduler_creator(optimizer, {})
    loader = train_torch.prepare_data_loader(
        torch.utils.data.DataLoader(lm.Tokens(), batch_size=lm.GLOBAL_BATCH)
    )
    losses = []
    for batch in loader:  # TP alone: every worker reads every global batch
        train_torch.zero_grad()
        loss = model(**batch).loss
        train_torch.backward(loss)
        train_torch.step()
        scheduler.step()
        losses.append(loss.item())
    report({"losses": losses})


def test_the_function_api_takes_parallelism_in_prepare(ray_start_4_cpus, tmp_path):
    from polytrain.train import RunConfig, ScalingConfig
    from polytrain.train.torch import TorchTrainer as FunctionTrainer

    result = FunctionTrainer(
        tp_loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="tp"),
        backend="fsdp",
    ).fit()
    assert result.error is None
    _, losses, _ = lm.reference("llama", clip=False, accumulate=False)
    assert result.metrics["losses"] == pytest.approx(losses, rel=TOLERANCE)


def _on_two_nodes(tmp_path: Path, layout: str) -> dict:
    result = run_script_on_fresh_cluster(SCRIPT, tmp_path / "result.json", layout)[layout]
    assert result["status"] == "ok", result.get("error")
    return result


def _assert_equal_to_reference(result: dict) -> None:
    pairs = zip(result["losses"], result["reference_losses"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    print(f"[parallelism] two nodes: per-step loss max rel diff {worst:.1e}")
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE)
    assert result["norms"] == pytest.approx(result["reference_norms"], rel=TOLERANCE)
    assert result["num_samples"] == lm.ACCUMULATION * lm.GLOBAL_BATCH


def test_hsdp_2x2_replicates_across_two_nodes_and_equals_one_process(tmp_path):
    """Two simulated nodes of 2 workers: each shard group inside a node, each replica pair across."""
    result = _on_two_nodes(tmp_path, "hsdp")
    _assert_equal_to_reference(result)
    node_of = {w["rank"]: w["node_ip"] for w in result["workers"]}
    assert sorted(set(node_of.values())) == ["127.0.0.2", "127.0.0.3"]
    for worker in result["workers"]:
        shard_group, replicas = worker["groups"]["dp_shard"], worker["groups"]["dp_replicate"]
        assert worker["rank"] in shard_group and worker["rank"] in replicas
        assert {node_of[r] for r in shard_group} == {worker["node_ip"]}  # inside its node
        assert len({node_of[r] for r in replicas}) == 2  # across both nodes


def test_deepspeed_autotp_2_x_zero_and_hpz_2x2_equal_one_process(
    ray_start_4_cpus, no_leftover_actors, tmp_path
):
    """tp as DeepSpeed's AutoTP (over ZeRO-2), dp_replicate x dp_shard as ZeRO-3 + hpZ.

    AutoTP's checkpoint holds the whole weights (gathered from its slices), which
    load under ddp on one worker; its optimizer state has no portable form.
    """
    pytest.importorskip("deepspeed")
    for parallelism, backend_config in [
        ({"dp_shard": 2, "tp": 2}, None),
        ({"dp_replicate": 2, "dp_shard": 2}, {"stage": 3}),
    ]:
        trainer = make_trainer(
            "llama", parallelism, backend="deepspeed", backend_config=backend_config
        )
        try:
            stats = train_steps(trainer)
            trained = trainer.get_model()
            if parallelism.get("tp"):
                trainer.save(tmp_path / "autotp.pt")
        finally:
            trainer.shutdown()
        assert_matches_reference(stats, trained, "llama", f"deepspeed {parallelism}")
    other = make_trainer("llama", None, num_workers=0, backend="ddp")
    try:
        other.load(tmp_path / "autotp.pt")
        assert max_diff(other.get_model(), lm.reference("llama")[0]) < WEIGHT_TOLERANCE
    finally:
        other.shutdown()


# ----------------------------------------------------------- make test-long
LONG_LAYOUTS = [
    pytest.param("llama", {"dp_replicate": 2, "dp_shard": 2}, {}, id="llama-hsdp2x2"),
    pytest.param("llama", {"dp_replicate": 2, "tp": 2}, {}, id="llama-tp2-x-replicate2"),
    pytest.param("llama", {"dp_shard": 2, "tp": 2}, {"config": {"tie": True}}, id="llama-tied"),
    pytest.param("gpt2", {"tp": 2}, {}, id="gpt2-tp2"),
    pytest.param("gpt2", {"dp_replicate": 2, "dp_shard": 2}, {}, id="gpt2-hsdp2x2"),
    pytest.param("llama", {"dp_shard": 2, "tp": 2}, {"compile": True}, id="llama-compile"),
]


@pytest.mark.long_matrix
@pytest.mark.parametrize(("model", "parallelism", "options"), LONG_LAYOUTS)
def test_more_layouts_equal_one_process(
    ray_start_4_cpus, no_leftover_actors, model, parallelism, options
):
    trainer = make_trainer(model, parallelism, **options)
    try:
        stats = train_steps(trainer)
        trained = trainer.get_model()
    finally:
        trainer.shutdown()
    layout = f"fsdp {parallelism} {options}"
    assert_matches_reference(stats, trained, model, layout, **options.get("config", {}))


@pytest.mark.long_matrix
def test_tp_with_replicas_across_two_nodes(tmp_path):
    """GPT-2 TP 2 inside each simulated node, its two replicas across the nodes."""
    result = _on_two_nodes(tmp_path, "tp_hsdp")
    _assert_equal_to_reference(result)
    node_of = {w["rank"]: w["node_ip"] for w in result["workers"]}
    for worker in result["workers"]:
        assert {node_of[r] for r in worker["groups"]["tp"]} == {worker["node_ip"]}
        assert len({node_of[r] for r in worker["groups"]["dp_replicate"]}) == 2


@pytest.mark.long_matrix
def test_bf16_under_tp_stays_close_to_fp32(ray_start_4_cpus, no_leftover_actors):
    """bf16 (FSDP2's MixedPrecisionPolicy) under TP 2 x FSDP 2: bf16 rounding, not a different run."""
    trainer = make_trainer("llama", {"dp_shard": 2, "tp": 2}, precision="bf16")
    try:
        stats = train_steps(trainer)
    finally:
        trainer.shutdown()
    _, losses, norms = lm.reference("llama")
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=1e-2)
    assert [s["grad_norm"] for s in stats] == pytest.approx(norms, rel=5e-2)


@pytest.mark.long_matrix
def test_sharded_checkpoints_of_interleaved_and_replicated_layouts_load_anywhere(
    ray_start_4_cpus, no_leftover_actors, tmp_path
):
    """GPT-2 under TP 2 x 2 replicas -> ddp on 1 worker; HSDP 2x2 -> TP 2 x FSDP 2."""
    from tests.integration.test_checkpoint_dir import assert_same_state

    saved = {}
    for name, model, parallelism in [
        ("gpt2", "gpt2", {"dp_replicate": 2, "tp": 2}),
        ("hsdp", "llama", {"dp_replicate": 2, "dp_shard": 2}),
    ]:
        folder = tmp_path / name
        trainer = make_trainer(
            model, parallelism, checkpoint_config={"checkpoint_dir": str(folder)}
        )
        try:
            trainer.train()
            saved[name] = (str(folder / "checkpoint_000001"), trainer.state_dict())
        finally:
            trainer.shutdown()
    for name, model, parallelism, workers, backend in [
        ("gpt2", "gpt2", None, 0, "ddp"),
        ("hsdp", "llama", {"dp_shard": 2, "tp": 2}, 4, "fsdp"),
    ]:
        other = make_trainer(model, parallelism, num_workers=workers, backend=backend)
        try:
            other.load(saved[name][0])
            assert_same_state(saved[name][1], other.state_dict())
        finally:
            other.shutdown()


@pytest.mark.long_matrix
def test_a_model_without_a_plan_and_heads_not_divisible_fail_on_the_workers_with_the_reason(
    ray_start_4_cpus, no_leftover_actors
):
    from polytrain.errors import ConfigError
    from tests.helpers import parity_data_creator, parity_model_creator, parity_optimizer_creator

    with pytest.raises(ConfigError, match="needs a tensor-parallel plan for Sequential"):
        TorchTrainer(
            model_creator=parity_model_creator,
            data_creator=parity_data_creator,
            optimizer_creator=parity_optimizer_creator,
            loss_creator=torch.nn.CrossEntropyLoss,
            config={"batch_size": 32},
            num_workers=2,
            backend="fsdp",
            parallelism={"tp": 2},
            failure_config={"max_retries": 0},
        )
    with pytest.raises(ConfigError, match="num_key_value_heads=2, which is not divisible by 4"):
        make_trainer("llama", {"tp": 4})
    # get_peft_model in the creator: the workers see the adapters and refuse TP.
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=r"tp=2 cannot split a model with PEFT adapters"):
        TorchTrainer(
            model_creator=_lora_llama_creator,
            data_creator=lm.data_creator,
            optimizer_creator=lm.sgd_creator,
            config={"batch_size": lm.GLOBAL_BATCH},
            num_workers=2,
            backend="fsdp",
            parallelism={"tp": 2},
            failure_config={"max_retries": 0},
        )


def _lora_llama_creator(config: dict) -> torch.nn.Module:
    import peft

    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(lm.CREATORS["llama"](config), lora)
