"""Encoded examples to training rows: padded one per row, or packed several per row.

Padded rows carry ``input_ids``, ``attention_mask`` and ``labels``. Packed rows
carry ``input_ids``, ``labels`` and ``position_ids`` that restart at 0 for every
example and no ``attention_mask``: from these, transformers' models (those built
on ``transformers.masking_utils``, GPT-2, Llama, Qwen, Mistral, ... in
transformers 5) find the examples of a row and attend within each one only, on
every attention implementation (eager, sdpa, flex, flash-attention's varlen
kernels): a packed row trains as its examples would, each in its own row. They do
so only without a key/value cache: the forward pass needs ``use_cache=False``
(which :meth:`~polytrain.hf.data.pipeline.InstructionFormat.collate` and
:class:`~polytrain.hf.data.token_mean.TokenMeanOperator` pass; else set
``model.config.use_cache = False``). A model that ignores ``position_ids`` for
masking, or one run with its cache, attends across the examples of a row (plain
concatenation, as HF's ``ConstantLengthDataset``); the labels stay right either
way, since the first token of every example is never a label.

Packing is greedy and keeps the order: an example goes into the current row when
it fits, else it starts the next row; an example is never split across rows. The
rest of a row is padding (its own positions from 0, label ``IGNORE_INDEX``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polytrain.errors import ConfigError
from polytrain.hf.data.encoding import IGNORE_INDEX

__all__ = ["Encoded", "pack_rows", "pad_rows"]

#: One encoded example: ``(input_ids, labels)``, equally long.
Encoded = tuple[Sequence[int], Sequence[int]]


def pad_rows(examples: Sequence[Encoded], length: int | None, pad_id: int) -> dict[str, np.ndarray]:
    """One row per example, right-padded to ``length`` (None: the longest example).

    Raises:
        ConfigError: an example longer than ``length``.
    """
    longest = max((len(ids) for ids, _ in examples), default=0)
    length = longest if length is None else length
    if longest > length:
        raise ConfigError(f"An example of {longest} tokens does not fit a row of {length}.")
    ids = np.full((len(examples), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(examples), length), dtype=np.int64)
    labels = np.full((len(examples), length), IGNORE_INDEX, dtype=np.int64)
    for row, (example_ids, example_labels) in enumerate(examples):
        n = len(example_ids)
        ids[row, :n] = example_ids
        mask[row, :n] = 1
        labels[row, :n] = example_labels
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack_rows(examples: Sequence[Encoded], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Whole examples, in order, into as few rows of ``length`` as greedy filling makes.

    Raises:
        ConfigError: an example longer than ``length`` (encode with ``max_length`` <= it).
    """
    rows: list[list[Encoded]] = []
    used = length  # start a row at the first example
    for example in examples:
        n = len(example[0])
        if n > length:
            raise ConfigError(f"An example of {n} tokens does not fit a packed row of {length}.")
        if used + n > length:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += n
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(rows), length), dtype=np.int64)
    for row, members in enumerate(rows):
        start = 0
        for example_ids, example_labels in members:
            end = start + len(example_ids)
            ids[row, start:end] = example_ids
            labels[row, start:end] = example_labels
            positions[row, start:end] = np.arange(end - start)
            start = end
        positions[row, start:] = np.arange(length - start)  # padding: a "document" of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
