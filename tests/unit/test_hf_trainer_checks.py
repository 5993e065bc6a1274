"""prepare_trainer, RayTrainReportCallback and the Accelerate check, on bad input (no Ray).

The checks read what Accelerate really built: an ``Accelerator`` and an HF
``Trainer`` are made in this process (one process, CPU) and reset afterwards.
"""

from __future__ import annotations

import pytest

from polytrain.backends.core.context import WorkerContext
from polytrain.backends.registry import get_backend
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.train.huggingface.accelerate_scope import AccelerateScope, check_state, loop_env
from polytrain.train.session import SessionMisuseError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator; Accelerate's process-wide state is reset after the test."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_prepare_trainer_outside_a_worker_names_where_to_call_it(tmp_path, accelerator):
    from transformers import Trainer, TrainingArguments

    from polytrain.train.huggingface.transformers import prepare_trainer
    from tests.integration.hf_helpers import TokenDataset, tiny_gpt2

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(4))
    with pytest.raises(SessionMisuseError, match="inside the train_loop_per_worker"):
        prepare_trainer(trainer)


def test_prepare_trainer_refuses_what_is_not_a_trainer():
    from polytrain.train.huggingface.transformers import prepare_trainer

    with pytest.raises(ConfigTypeError, match="takes a transformers.Trainer"):
        prepare_trainer(object())


def test_an_old_trl_trainer_without_callback_hooks_names_the_upgrade():
    from polytrain.train.huggingface.transformers import prepare_trainer

    # Older TRL trainers (PPOTrainer before TRL 0.12) were not transformers.Trainer
    # subclasses; one is stood in for by a class of that module path.
    old = type("PPOTrainer", (), {"__module__": "trl.trainer.ppo_trainer"})
    with pytest.raises(ConfigTypeError, match=r"pip install -U 'trl>=0\.12'"):
        prepare_trainer(old())


def test_an_accelerator_that_contradicts_the_backend_is_refused(accelerator):
    # The worker expects Accelerate's FSDP (the fsdp backend on GPUs); the script's
    # Accelerator trains without it.
    scope = AccelerateScope(backend="fsdp", world_size=1, expected="FSDP")
    with pytest.raises(ConfigError, match=r"Accelerate set up NO over 1 process.*contradicts"):
        check_state(scope, accelerator.state, "The Accelerator in train_loop_per_worker")
    scope = AccelerateScope(backend="ddp", world_size=1, expected="NO")
    check_state(scope, accelerator.state, "ok")
    assert scope.checked


def test_a_refused_backend_is_refused_where_accelerate_is_used(accelerator):
    ctx = WorkerContext(world_size=2, use_gpu=False)
    env, scope = loop_env(get_backend("fsdp"), ctx)
    # The loop still gets the device and Accelerate's CPU mode; the refusal waits for a use.
    assert env == {"ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_USE_CPU": "true"}
    with pytest.raises(ConfigError, match="prepare_trainer: The fsdp backend cannot run"):
        check_state(scope, accelerator.state, "prepare_trainer")


def test_the_loop_env_of_ddp_on_cpu_and_of_fp16():
    env, scope = loop_env(get_backend("ddp"), WorkerContext(world_size=2, use_fp16=True))
    assert env == {
        "ACCELERATE_TORCH_DEVICE": "cpu",
        "ACCELERATE_USE_CPU": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    assert (scope.expected, scope.refusal) == ("MULTI_CPU", None)
