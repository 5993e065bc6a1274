"""Instruction data (polytrain.hf.data): exact label layouts of masking and packing, templates,
and a packed row training as its examples would apart (a real GPT-2, in-process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.hf.data import (
    IGNORE_INDEX,
    ChatTemplate,
    InstructionFormat,
    PromptTemplate,
    TemplateError,
    encode_pair,
    instruction_loader,
    pack_rows,
    pad_rows,
    step_token_count,
)
from polytrain.trainer_api.torch.default_step import batch_counts
from tests.instruction_helpers import PROMPT, RESPONSE, build_tokenizer, make_examples, tiny_gpt2

X = IGNORE_INDEX


# ------------------------------------------------------------------ masking
def test_the_prompt_and_the_first_token_are_masked_and_the_response_trained():
    ids, labels = encode_pair([5, 6, 7], [8, 9, 3], max_length=16)
    assert ids == [5, 6, 7, 8, 9, 3]
    assert labels == [X, X, X, 8, 9, 3]
    # Unmasked: every token trains but the first, which nothing in the example predicts.
    assert encode_pair([5, 6, 7], [8, 9, 3], 16, mask_prompt=False)[1] == [X, 6, 7, 8, 9, 3]
    # Too long: the prompt stays, the response loses its end.
    assert encode_pair([5, 6, 7], [8, 9, 3], max_length=4) == ([5, 6, 7, 8], [X, X, X, 8])
    # A prompt that fills the row trains nothing.
    assert encode_pair([5, 6, 7], [8], max_length=3) == ([5, 6, 7], [X, X, X])


# ------------------------------------------------------------------ rows
def test_padded_rows_layout():
    rows = pad_rows([([5, 6, 7], [X, 6, 7]), ([8, 9], [X, 9])], length=None, pad_id=0)
    np.testing.assert_array_equal(rows["input_ids"], [[5, 6, 7], [8, 9, 0]])
    np.testing.assert_array_equal(rows["attention_mask"], [[1, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(rows["labels"], [[X, 6, 7], [X, 9, X]])
    assert pad_rows([([5], [X])], length=4, pad_id=1)["input_ids"].tolist() == [[5, 1, 1, 1]]
    with pytest.raises(ConfigError, match="3 tokens does not fit a row of 2"):
        pad_rows([([5, 6, 7], [X, 6, 7])], length=2, pad_id=0)


def test_packed_rows_layout_keeps_examples_whole_and_apart():
    a = ([10, 11, 12], [X, X, 12])
    b = ([20, 21], [X, 21])
    c = ([30, 31, 32, 33], [X, X, 32, 33])
    rows = pack_rows([a, b, c], length=6, pad_id=0)
    # a and b share a row; c does not fit after them and starts the next (never split).
    np.testing.assert_array_equal(
        rows["input_ids"], [[10, 11, 12, 20, 21, 0], [30, 31, 32, 33, 0, 0]]
    )
    # No label crosses an example: each example's first token is masked, so the last
    # token of one never predicts the first of the next; padding trains nothing.
    np.testing.assert_array_equal(rows["labels"], [[X, X, 12, X, 21, X], [X, X, 32, 33, X, X]])
    # Positions restart for every example (and for the padding, a "document" of its own).
    np.testing.assert_array_equal(rows["position_ids"], [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert "attention_mask" not in rows  # the positions are the boundaries
    assert pack_rows([a, b], length=5, pad_id=0)["input_ids"].shape == (1, 5)  # exactly full
    with pytest.raises(ConfigError, match="4 tokens does not fit a packed row of 3"):
        pack_rows([c], length=3, pad_id=0)


def test_token_counts_are_the_trained_labels():
    rows = pack_rows([([10, 11, 12], [X, X, 12]), ([20, 21], [X, 21])], length=6, pad_id=0)
    batch = {key: torch.from_numpy(value) for key, value in rows.items()}
    assert batch_counts(batch, batch["labels"])["num_tokens"] == 2
    assert step_token_count(batch) == 2
    padded = pad_rows([([5, 6, 7], [X, X, 7]), ([8, 9], [X, 9])], length=None, pad_id=0)
    batch = {key: torch.from_numpy(value) for key, value in padded.items()}
    # labels win over the attention mask: the prompt is read, not trained.
    assert batch_counts(batch, batch["labels"])["num_tokens"] == 2
    with pytest.raises(ConfigTypeError, match="integer 'labels'"):
        step_token_count({"input_ids": batch["input_ids"]})


# ------------------------------------------------------------------ templates
def test_prompt_template_splits_and_names_missing_columns():
    template = PromptTemplate("Q: {question}\nA:", " {answer}")
    assert template.split({"question": "2+2?", "answer": "4"}) == ("Q: 2+2?\nA:", " 4")
    with pytest.raises(TemplateError, match=r"\['answer'\].*its columns: \['question'\]"):
        template.split({"question": "2+2?"})
    with pytest.raises(ConfigError, match="names no column"):
        PromptTemplate("plain text", "more")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _format(tokenizer_dir, **kwargs) -> InstructionFormat:
    return InstructionFormat(
        tokenizer=tokenizer_dir, template=PromptTemplate(PROMPT, RESPONSE), **kwargs
    )


def test_an_example_is_encoded_with_bos_eos_and_the_prompt_masked(tokenizer_dir):
    fmt = _format(tokenizer_dir, max_length=32)
    example = {"operation": "reverse", "words": "red blue", "answer": "blue red"}
    ids, labels = fmt.encode(example)
    tokens = fmt.loaded_tokenizer.convert_ids_to_tokens(ids)
    prompt = ["[BOS]", "###", "Instruction:", "reverse", "red", "blue", "###", "Response:"]
    assert tokens == [*prompt, "blue", "red", "[EOS]"]
    assert labels == [X] * len(prompt) + ids[len(prompt) :]


def test_chat_template_trains_the_last_assistant_turn_only(tokenizer_dir):
    fmt = InstructionFormat(tokenizer=tokenizer_dir, template=ChatTemplate(), max_length=32)
    chat = [
        {"role": "user", "content": "red"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "gold"},
        {"role": "assistant", "content": "teal"},
    ]
    ids, labels = fmt.encode({"messages": chat})
    tokenizer = fmt.loaded_tokenizer
    trained = [t for t, label in zip(ids, labels, strict=True) if label != X]
    # The chat template's own end of turn ([EOS]) closes the answer; no BOS or EOS added.
    assert tokenizer.convert_ids_to_tokens(trained) == ["teal", "[EOS]"]
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == ["<|user|>", "red"]
    with pytest.raises(TemplateError, match="must be the assistant's.*'user'"):
        fmt.encode({"messages": chat[:3]})


def test_bad_formats_are_refused(tokenizer_dir):
    with pytest.raises(ConfigError, match="max_length must be >= 2"):
        _format(tokenizer_dir, max_length=1)
    with pytest.raises(ConfigTypeError, match="pack must be True or False"):
        _format(tokenizer_dir, max_length=8, pack="yes")
    with pytest.raises(ConfigError, match="not a directory on this machine"):
        InstructionFormat(tokenizer="gpt2", template=PromptTemplate(PROMPT), max_length=8).encode(
            {}
        )
    bad = InstructionFormat(tokenizer=tokenizer_dir, template=lambda e: "one", max_length=8)
    with pytest.raises(TemplateError, match=r"must return \(prompt, response\)"):
        bad.encode({"x": 1})
    with pytest.raises(ConfigError, match="makes its own collate_fn"):
        instruction_loader([], _format(tokenizer_dir, max_length=8), 2, collate_fn=list)


def test_map_batches_rows_are_fixed_length_columns(tokenizer_dir):
    examples = make_examples(6)
    columns = {key: np.array([e[key] for e in examples]) for key in examples[0]}
    for pack in (False, True):
        fmt = _format(tokenizer_dir, max_length=40, pack=pack)
        rows = fmt(columns)
        encoded = [fmt.encode(e) for e in examples]
        assert all(v.shape[1] == 40 for v in rows.values())
        assert int((rows["labels"] != X).sum()) == sum(
            sum(label != X for label in labels) for _, labels in encoded
        )
        assert rows["input_ids"].shape[0] == (2 if pack else 6)


# ------------------------------------------------------------------ attention across examples
def test_a_packed_batch_trains_exactly_as_its_examples_apart(tokenizer_dir):
    """Packed rows (positions restarting, no cache) give each example the logits it gets
    alone: the same summed loss and the same gradients as one padded row per example."""
    examples = make_examples(12, seed=3)
    packed_fmt = _format(tokenizer_dir, max_length=48, pack=True)
    encoded = [packed_fmt.encode(e) for e in examples]
    packed = packed_fmt.collate(encoded)
    padded = _format(tokenizer_dir, max_length=48).collate(encoded)
    assert packed["input_ids"].shape[0] < len(examples)  # it did pack
    vocab = len(packed_fmt.loaded_tokenizer)

    def summed_loss_and_grads(batch):
        model = tiny_gpt2(vocab)
        # The model's loss with num_items_in_batch=1 is the sum over trained tokens.
        loss = model(**batch, num_items_in_batch=1).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    packed_loss, packed_grads = summed_loss_and_grads(packed)
    padded_loss, padded_grads = summed_loss_and_grads(padded)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6)
    # With the key/value cache on, GPT-2 attends across the packed examples: not the same.
    crossing = tiny_gpt2(vocab)(**{**packed, "use_cache": True}, num_items_in_batch=1).loss
    # (A fresh model's attention is nearly uniform: the difference is small, yet 100 times the
    # tolerance the isolated rows meet above.)
    assert abs(crossing.item() - padded_loss) > 1e-4 * padded_loss


# ------------------------------------------------------------------ the token-mean loss
def test_accumulated_micro_batches_train_as_one_batch_of_their_tokens(tokenizer_dir):
    """Local mode (one process, no Ray): 2 micro-batches of 4 packed examples per step equal
    one step over the 8 examples unpacked, although the micro-batches hold different numbers
    of trained tokens."""
    from polytrain import TorchTrainer
    from polytrain.hf.data import TokenMeanOperator

    examples = make_examples(16, seed=5)
    vocab = len(_format(tokenizer_dir, max_length=48).loaded_tokenizer)

    def optimizer_creator(model, config):
        return torch.optim.SGD(model.parameters(), lr=0.5)

    trainer = TorchTrainer(
        model_creator=lambda config: tiny_gpt2(vocab),
        data_creator=lambda config: instruction_loader(
            examples, _format(tokenizer_dir, max_length=48, pack=True), config["batch_size"]
        ),
        optimizer_creator=optimizer_creator,
        training_operator_cls=TokenMeanOperator,
        config={"batch_size": 4},
        num_workers=0,
        gradient_accumulation_steps=2,
    )
    try:
        stats = [trainer.train(num_steps=1) for _ in range(2)]
        model = trainer.get_model()
    finally:
        trainer.shutdown()
    reference = tiny_gpt2(vocab)
    optimizer = optimizer_creator(reference, {})
    fmt = _format(tokenizer_dir, max_length=48)
    losses, tokens = [], []
    for step in range(2):
        batch = fmt.collate([fmt.encode(e) for e in examples[8 * step : 8 * step + 8]])
        optimizer.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        tokens.append(int((batch["labels"] != X).sum()))
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=1e-5)
    assert [s["num_tokens"] for s in stats] == tokens
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-5)


def test_token_mean_operator_refuses_a_loss_creator(tokenizer_dir):
    from polytrain import TorchTrainer
    from polytrain.errors import WorkerError
    from polytrain.hf.data import TokenMeanOperator

    with pytest.raises((ConfigError, WorkerError), match="uses the model's own loss"):
        TorchTrainer(
            model_creator=lambda config: tiny_gpt2(32),
            data_creator=lambda config: instruction_loader(
                make_examples(4), _format(tokenizer_dir, max_length=48), 2
            ),
            optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
            loss_creator=torch.nn.CrossEntropyLoss,
            training_operator_cls=TokenMeanOperator,
            config={"batch_size": 2},
            num_workers=0,
        )
