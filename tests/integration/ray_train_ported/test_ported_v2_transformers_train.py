"""Ray Train 2.60's HF Trainer cases (``ray/train/v2/tests/test_torch_transformers_train.py``) on polytrain.

The same three cases, constants and assertions, with ``ray.train`` replaced by
``polytrain.train``. What differs, and why:

- the model is a 2-layer GPT-2 built from a config and the data is generated here
  (Ray's test downloads ``hf-internal-testing/tiny-random-BloomForCausalLM`` and
  ships tokenized wikitext; nothing can be downloaded here);
- ``eval_strategy`` and ``use_cpu`` are the transformers 5 names of Ray's
  ``evaluation_strategy`` and ``no_cuda``;
- Ray's ``ray_start_6_cpus_2_gpus`` fixture is the suite's shared Ray instance
  (the CPU cases use no GPU), and the Trainer's ``output_dir`` is under the test's
  ``tmp_path`` instead of the worker's working directory.
"""

from __future__ import annotations

import pytest
import ray.data

from polytrain.train import Checkpoint, ScalingConfig, get_dataset_shard
from polytrain.train.torch import TorchTrainer
from tests.integration.hf_helpers import SEQ, VOCAB, tiny_gpt2

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from polytrain.train.huggingface.transformers import (  # noqa: E402
    RayTrainReportCallback,
    prepare_trainer,
)

NUM_WORKERS = 2
BATCH_SIZE_PER_WORKER = 2
TRAIN_DATASET_SIZE = 16
MAX_EPOCHS = 1
STEPS_PER_EPOCH = TRAIN_DATASET_SIZE // (BATCH_SIZE_PER_WORKER * NUM_WORKERS)
MAX_STEPS = MAX_EPOCHS * STEPS_PER_EPOCH

STEPS_CPU = {
    "eval_strategy": "steps",
    "save_strategy": "steps",
    "logging_strategy": "steps",
    "eval_steps": STEPS_PER_EPOCH,
    "save_steps": STEPS_PER_EPOCH,
    "logging_steps": 1,
    "use_cpu": True,
}


@pytest.fixture
def ray_start_6_cpus_2_gpus(ray_start_4_cpus):
    return ray_start_4_cpus


def _rows(size: int, seed: int) -> dict[str, list]:
    """Tokenized rows as Ray's wikitext sample has them: input_ids, attention_mask, labels."""
    import torch

    ids = torch.randint(0, VOCAB - 2, (size, SEQ), generator=torch.Generator().manual_seed(seed))
    rows = ids.tolist()
    return {"input_ids": rows, "attention_mask": [[1] * SEQ for _ in rows], "labels": rows}


def _frames():
    import pandas as pd

    return pd.DataFrame(_rows(TRAIN_DATASET_SIZE, 0)), pd.DataFrame(_rows(8, 1))


def train_func(config):
    if config["use_ray_data"]:
        batches = {"batch_size": BATCH_SIZE_PER_WORKER}
        train_dataset = get_dataset_shard("train").iter_torch_batches(**batches)
        if config.get("use_dict_eval_datasets"):
            eval_dataset = {
                name: get_dataset_shard(name).iter_torch_batches(**batches)
                for name in ("eval_1", "eval_2")
            }
        else:
            eval_dataset = get_dataset_shard("eval").iter_torch_batches(**batches)
    else:
        train_df, eval_df = _frames()
        train_dataset = datasets.Dataset.from_pandas(train_df)
        eval_dataset = datasets.Dataset.from_pandas(eval_df)
    args = transformers.TrainingArguments(
        config["output_dir"],
        eval_strategy=config["eval_strategy"],
        logging_strategy=config["logging_strategy"],
        save_strategy=config["save_strategy"],
        eval_steps=config["eval_steps"],
        save_steps=config["save_steps"],
        logging_steps=config["logging_steps"],
        num_train_epochs=config.get("num_train_epochs", MAX_EPOCHS),
        max_steps=config.get("max_steps", -1),
        learning_rate=config.get("learning_rate", 2e-5),
        per_device_train_batch_size=BATCH_SIZE_PER_WORKER,
        per_device_eval_batch_size=BATCH_SIZE_PER_WORKER,
        weight_decay=0.01,
        disable_tqdm=True,
        use_cpu=config["use_cpu"],
        report_to="none",
    )
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    trainer.train()


def _fit(config, datasets=None):
    return TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=NUM_WORKERS, use_gpu=not config["use_cpu"]),
        datasets=datasets,
    ).fit()


def _check_result(result, config):
    """The assertions every case of Ray's file makes."""
    assert result.metrics["step"] == MAX_STEPS
    assert result.checkpoint
    assert isinstance(result.checkpoint, Checkpoint)
    assert len(result.best_checkpoints) == MAX_STEPS // config["save_steps"]


def test_e2e_hf_data(ray_start_6_cpus_2_gpus, tmp_path):
    config = {**STEPS_CPU, "use_ray_data": False, "num_train_epochs": MAX_EPOCHS}
    config["output_dir"] = str(tmp_path / "tiny-gpt2-wikitext2")
    result = _fit(config)
    assert result.metrics["epoch"] == MAX_EPOCHS
    _check_result(result, config)
    assert "eval_loss" in result.metrics


def test_e2e_ray_data(ray_start_6_cpus_2_gpus, tmp_path):
    config = {**STEPS_CPU, "use_ray_data": True, "max_steps": MAX_STEPS}
    config["output_dir"] = str(tmp_path / "tiny-gpt2-wikitext2")
    train_df, eval_df = _frames()
    result = _fit(
        config, {"train": ray.data.from_pandas(train_df), "eval": ray.data.from_pandas(eval_df)}
    )
    _check_result(result, config)
    assert "eval_loss" in result.metrics


def test_e2e_dict_eval_ray_data(ray_start_6_cpus_2_gpus, tmp_path):
    config = {**STEPS_CPU, "use_ray_data": True, "use_dict_eval_datasets": True}
    config["max_steps"] = MAX_STEPS
    config["output_dir"] = str(tmp_path / "tiny-gpt2-wikitext2")
    train_df, eval_df = _frames()
    result = _fit(
        config,
        {
            "train": ray.data.from_pandas(train_df),
            "eval_1": ray.data.from_pandas(eval_df),
            "eval_2": ray.data.from_pandas(eval_df),
        },
    )
    _check_result(result, config)
    assert "eval_eval_1_loss" in result.metrics
    assert "eval_eval_2_loss" in result.metrics
