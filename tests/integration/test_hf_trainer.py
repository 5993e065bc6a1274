"""An unmodified HF Trainer script (and TRL's SFTTrainer) inside ``train_loop_per_worker``.

Two ddp workers on CPU train a 2-layer GPT-2 with ``transformers.Trainer``; the
per-step losses equal one process's ``Trainer`` on the same global batches (the
Trainer's sampler draws one order for the whole data set and Accelerate hands
batch ``2k`` to rank 0 and ``2k + 1`` to rank 1, so global step ``k`` is one
process's batch ``k`` of twice the size). One worker is killed mid-run; the run
restarts and the Trainer resumes from the HF checkpoint it reported.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest

from polytrain.train import FailureConfig, RunConfig, ScalingConfig, get_checkpoint, get_context
from polytrain.train.torch import TorchTrainer
from tests.integration.hf_helpers import (
    TokenDataset,
    step_losses,
    text_dataset,
    tiny_gpt2,
    word_tokenizer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from polytrain.train.huggingface.transformers import (  # noqa: E402
    RayTrainReportCallback,
    prepare_trainer,
)

STEPS = 6
PER_WORKER = 4
TOL = 1e-5  # measured: 2.4e-7 on 6 steps without the kill


def _args(output_dir: str, batch: int, **extra) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir,
        per_device_train_batch_size=batch,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **extra,
    )


class _KillRank1(transformers.TrainerCallback):
    """Kills rank 1's worker process after step ``at`` (its checkpoint at step 2 is reported)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at and get_context().get_world_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def _write_log(config: dict, trainer, resumed: bool) -> None:
    if get_context().get_world_rank() == 0:
        with open(os.path.join(config["dir"], "log.json"), "w") as handle:
            json.dump(
                {"resumed": resumed, "losses": step_losses(trainer.state.log_history)}, handle
            )


def hf_trainer_loop(config):
    """The Ray Train HF Trainer recipe, with polytrain's imports."""
    args = _args(os.path.join(config["dir"], "hf"), PER_WORKER)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(64))
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    checkpoint = get_checkpoint()
    if checkpoint is None:
        trainer.add_callback(_KillRank1(config["kill_at"]))
        trainer.train()
    else:
        with checkpoint.as_directory() as d:
            trainer.train(resume_from_checkpoint=os.path.join(d, "checkpoint"))
    _write_log(config, trainer, checkpoint is not None)


def _single_process_losses() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        args = _args(d, 2 * PER_WORKER, use_cpu=True)
        trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(64))
        trainer.train()
    return {str(step): loss for step, loss in step_losses(trainer.state.log_history).items()}


def test_hf_trainer_equals_one_process_and_resumes_after_a_lost_worker(tmp_path, ray_start_4_cpus):
    reference = _single_process_losses()
    fit = TorchTrainer(
        hf_trainer_loop,
        train_loop_config={"dir": str(tmp_path), "kill_at": 3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path), name="hf", failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = fit.fit()
    assert fit.num_restarts == 1
    with open(tmp_path / "log.json") as handle:
        log = json.load(handle)
    # the second attempt resumed the Trainer from the step-2 checkpoint (steps 1-2 in its
    # restored log, 3-6 trained again) and every step equals one process
    assert log["resumed"] is True
    assert sorted(log["losses"], key=int) == [str(s) for s in range(1, STEPS + 1)]
    for step, loss in reference.items():
        assert abs(log["losses"][step] - loss) <= TOL, (step, log["losses"][step], loss)
    # metrics in the Result: the Trainer's logged metrics merged at the last save
    assert result.metrics["step"] == STEPS
    assert abs(result.metrics["loss"] - reference[str(STEPS)]) <= TOL
    # one polytrain checkpoint per HF save (steps 2, 4, 6), the HF folder inside
    assert [m["step"] for _, m in result.best_checkpoints] == [2, 4, 6]
    inside = sorted(os.listdir(os.path.join(result.checkpoint.path, "checkpoint")))
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_1.pth"):
        assert name in inside


def _sft_trainer(directory: str, batch: int, **extra):
    """TRL's SFTTrainer as a TRL script builds it."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        directory,
        per_device_train_batch_size=batch,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        max_length=16,
        bf16=False,  # TRL's default is bf16, which a CPU refuses without use_cpu
        **extra,
    )
    return SFTTrainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=text_dataset(32),
        processing_class=word_tokenizer(),
    )


def sft_loop(config):
    """The SFTTrainer with polytrain's imports: two workers of half the batch each."""
    trainer = _sft_trainer(os.path.join(config["dir"], "sft"), PER_WORKER // 2)
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    trainer.train()


def test_trl_sft_trainer_equals_one_process(tmp_path, ray_start_4_cpus):
    pytest.importorskip("trl")
    with tempfile.TemporaryDirectory() as d:
        from polytrain.train.huggingface.accelerate_scope import _reset_accelerate

        reference = _sft_single_process(d)
        _reset_accelerate()
    result = TorchTrainer(
        sft_loop,
        train_loop_config={"dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="sft"),
    ).fit()
    losses = {entry["step"]: entry["loss"] for entry in result.metrics_history}
    assert sorted(losses) == [2, 4]
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= TOL, (step, loss, reference[step])
    assert os.path.isfile(os.path.join(result.checkpoint.path, "checkpoint", "model.safetensors"))


def _sft_single_process(directory: str) -> dict[int, float]:
    trainer = _sft_trainer(directory, PER_WORKER, use_cpu=True)
    trainer.train()
    return step_losses(trainer.state.log_history)
