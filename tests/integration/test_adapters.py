"""Adapters out (issue 40, item 3), on real Ray workers: checkpoints, resume across backends, exports.

The LoRA run of ``test_peft`` (same base, batches, clipping, accumulation)
checkpoints after every optimizer step under fsdp2; rank 1's process dies in the
middle of the last step, the run restarts from its last checkpoint and ends at
the adapters and last loss of the uninterrupted one-process run. Its checkpoints
hold the adapters and their optimizer state, not the base (their tensors are
exactly the adapters and Adam's two moments), and name the base. A ZeRO-3 trainer (another layout: partitions
instead of rows) resumes from the checkpoint of step 2 and ends there too. Every
export is loaded back and gives the logits of the model it came from:
``save_pretrained`` (PEFT's layout, read by ``PeftModel.from_pretrained`` and by
``transformers``' own PEFT loading), ``save_pretrained(merge=True)`` (HF's
layout, read by ``from_pretrained``), and ``polytrain checkpoint convert --to
peft`` / ``--to safetensors --merge`` of the checkpoint offline (the merge reads
the base from its own directory); a plain ``--to safetensors`` of it is refused.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from polytrain import TrainingOperator  # noqa: E402
from polytrain.checkpoint.layout import open_checkpoint  # noqa: E402
from tests.integration.test_hf_export import _convert  # noqa: E402
from tests.integration.test_peft import (  # noqa: E402
    ACCUMULATION,
    STEPS,
    adapters_of,
    base_path,  # noqa: F401 - the module fixture
    make_trainer,
    max_diff,
    references,  # noqa: F401 - the module fixture
)


class DieInTheLastStep(TrainingOperator):
    """Rank 1's process exits at the first batch of the last step, once."""

    def train_batch(self, batch, batch_info):
        marker = self.config["die_marker"]
        last = (STEPS - 1) * ACCUMULATION
        if self.world_rank == 1 and batch_info["batch_idx"] == last and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return super().train_batch(batch, batch_info)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        return model(input_ids=ids).logits


def tensor_bytes(checkpoint: str) -> int:
    """The bytes of the tensors a checkpoint directory holds (its rank files)."""
    names = [f for f in os.listdir(checkpoint) if f.endswith(".bin")]
    return sum(os.path.getsize(os.path.join(checkpoint, f)) for f in names)


def test_adapter_checkpoints_resume_across_backends_and_every_export_loads_right(
    ray_start_4_cpus,
    no_leftover_actors,
    tmp_path,
    base_path,  # noqa: F811
    references,  # noqa: F811
):
    ref_model, ref_losses = references["clipped"]
    folder = tmp_path / "ckpt"
    first = make_trainer(
        base_path, "fsdp", {"version": 2}, "hf",
        training_operator_cls=DieInTheLastStep,
        config={"die_marker": str(tmp_path / "died")},
        failure_config={"max_retries": 1},
        checkpoint_config={"checkpoint_dir": str(folder), "every_n_steps": ACCUMULATION,
                           "num_to_keep": 10},
    )  # fmt: skip
    try:
        stats = [first.train(num_steps=1) for _ in range(STEPS)]
        killed_and_resumed = first.get_model()
    finally:
        first.shutdown()
    assert (tmp_path / "died").exists() and stats[-1]["num_restarts"] == 1
    assert stats[-1]["loss"] == pytest.approx(ref_losses[-1], rel=1e-4)
    assert max_diff(adapters_of(killed_and_resumed), adapters_of(ref_model)) < 1e-5
    step_2 = str(folder / f"checkpoint_000000.{(STEPS - 1) * ACCUMULATION:08d}")
    (entry,) = open_checkpoint(step_2).meta["frozen"]
    assert entry["base"] == base_path and len(entry["names"]) > 0
    adapters = adapters_of(ref_model)
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    steps = 8 * len(adapters)  # Adam's step count per parameter (a scalar)
    assert 3 * adapter_bytes <= tensor_bytes(step_2) <= 3 * adapter_bytes + steps  # no base

    second = make_trainer(base_path, "deepspeed", {"stage": 3}, "shortcut")
    try:
        second.load(step_2)
        at_step_2 = logits(second.get_model())
        second.train(num_steps=1)
        model = second.get_model()
        second.save_pretrained(tmp_path / "adapter")
        second.save_pretrained(tmp_path / "merged", merge=True, max_shard_size="60KB")
    finally:
        second.shutdown()
    assert max_diff(adapters_of(model), adapters_of(ref_model)) < 1e-5  # resharded, exactly

    expected = logits(model)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert torch.allclose(logits(auto), expected, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged), expected, atol=1e-5)
    assert len([f for f in os.listdir(tmp_path / "merged") if f.startswith("model-")]) > 1

    done = _convert("--to", "peft", step_2, str(tmp_path / "offline-adapter"))
    assert done.returncode == 0, done.stderr
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    offline = peft.PeftModel.from_pretrained(fresh, tmp_path / "offline-adapter")
    assert torch.allclose(logits(offline), at_step_2, atol=1e-5)
    done = _convert("--to", "safetensors", "--merge", step_2, str(tmp_path / "offline-merged"))
    assert done.returncode == 0, done.stderr
    offline = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "offline-merged")
    assert torch.allclose(logits(offline), at_step_2, atol=1e-5)
    done = _convert("--to", "safetensors", step_2, str(tmp_path / "raw"))
    assert done.returncode != 0 and "holds a PEFT model" in done.stderr
