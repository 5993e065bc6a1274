"""Instruction data on real workers: a ``load_from_disk`` folder (DataLoader path) and Ray Data,
masked prompts, packing and the token-mean loss, equal to one process training the same
examples (issue 40.4).

The reference is a plain single-process loop over the same examples, unpacked and padded,
with transformers' own loss (the mean over the batch's trained tokens).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from polytrain import TorchTrainer  # noqa: E402
from polytrain.hf.data import (  # noqa: E402
    IGNORE_INDEX,
    InstructionFormat,
    PromptTemplate,
    TokenMeanOperator,
    instruction_loader,
)
from tests.instruction_helpers import (  # noqa: E402
    PROMPT,
    RESPONSE,
    build_tokenizer,
    make_examples,
    tiny_gpt2,
)

pytestmark = pytest.mark.usefixtures("ray_start_4_cpus")

MAX_LENGTH = 48
LR = 0.5
STEPS = 4
STEP_EXAMPLES = 8  # examples per optimizer step (the global batch of a step)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tokenizer directory and a ``save_to_disk`` folder of generated instructions."""
    root = tmp_path_factory.mktemp("instructions")
    tokenizer = build_tokenizer(root / "tokenizer")
    datasets.Dataset.from_list(make_examples(64)).save_to_disk(str(root / "train"))
    return {"tokenizer": tokenizer, "folder": str(root / "train")}


def _format(config: dict) -> InstructionFormat:
    return InstructionFormat(
        tokenizer=config["tokenizer"],
        template=PromptTemplate(PROMPT, RESPONSE),
        max_length=MAX_LENGTH,
        pack=config.get("pack", False),
    )


def _vocab(config: dict) -> int:
    return len(_format(config).loaded_tokenizer)


def model_creator(config):
    return tiny_gpt2(_vocab(config), n_positions=MAX_LENGTH)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=LR)


def data_creator(config):
    # No shuffling: the distributed sampler's interleaving makes each step's examples the
    # reference's consecutive ones.
    examples = datasets.load_from_disk(config["folder"])
    return instruction_loader(examples, _format(config), config["batch_size"], shuffle=False)


def reference(config: dict, steps: list[list[dict]]):
    """One process, unpacked padded rows, transformers' mean loss, one step per list of
    examples: (losses, trained tokens, model)."""
    fmt = _format({**config, "pack": False})
    model = model_creator(config)
    optimizer = optimizer_creator(model, config)
    losses, tokens = [], []
    for examples in steps:
        batch = fmt.collate([fmt.encode(e) for e in examples])
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        tokens.append(int((batch["labels"] != IGNORE_INDEX).sum()))
    return losses, tokens, model


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def test_packed_masked_folder_on_two_ddp_workers_equals_one_process(data, no_leftover_actors):
    """2 workers x 2 micro-batches of 2 examples, each packed into rows of its own: every
    step trains the reference's 8 examples with its per-step loss and weights."""
    config = {**data, "pack": True, "batch_size": 4}  # global per micro-batch: 2 per worker
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        training_operator_cls=TokenMeanOperator,
        config=config,
        num_workers=2,
        backend="ddp",
        gradient_accumulation_steps=2,
        failure_config={"max_retries": 0},
    )
    try:
        stats = [trainer.train(num_steps=1) for _ in range(STEPS)]
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    examples = list(datasets.load_from_disk(data["folder"]))
    chunks = [examples[i * STEP_EXAMPLES : (i + 1) * STEP_EXAMPLES] for i in range(STEPS)]
    losses, tokens, ref_model = reference(data, chunks)
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=1e-5)
    assert max_diff(model, ref_model) < 1e-5
    # num_tokens: the trained (unmasked) labels of the step's 8 examples, over both workers.
    assert [s["num_tokens"] for s in stats] == tokens
    assert all(s["tokens_per_s"] > 0 for s in stats)
    read = sum(len(_format(data).encode(e)[0]) for chunk in chunks for e in chunk)
    assert sum(tokens) < 0.5 * read  # the prompts were read, not trained


def test_ray_data_rows_from_the_folder_train_like_one_process(data, no_leftover_actors):
    """The folder through Ray Data: tokenized in map_batches, split between 2 workers, one
    full-batch step per epoch (its gradient does not depend on which rows a worker got)."""
    import ray

    rows = 32
    folder = datasets.load_from_disk(data["folder"]).select(range(rows))
    # Tokenized once, in Ray Data's tasks; each epoch streams the materialized rows.
    dataset = ray.data.from_huggingface(folder).map_batches(_format(data), batch_size=8)
    dataset = dataset.materialize()
    trainer = TorchTrainer(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        training_operator_cls=TokenMeanOperator,
        datasets={"train": dataset},
        config={**data, "batch_size": rows},
        num_workers=2,
        failure_config={"max_retries": 0},
    )
    try:
        stats = [trainer.train() for _ in range(2)]
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    losses, tokens, ref_model = reference(data, [list(folder)] * 2)  # the same batch twice
    assert [s["num_steps"] for s in stats] == [1, 1]
    assert [s["num_tokens"] for s in stats] == tokens
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=1e-5)
    assert max_diff(model, ref_model) < 1e-5
