"""``InstructionFormat``: examples to training batches, on the data side of a run.

One object says how examples become rows (tokenizer, template, length, masking,
packing) and serves every input path:

- a ``DataLoader`` (a ``data_creator``, or ``prepare_data_loader`` in your own
  loop): :func:`instruction_loader` wraps any indexable examples (an HF
  ``datasets.Dataset`` from ``load_from_disk``, a list of dicts) in an
  :class:`InstructionDataset` that tokenizes in ``__getitem__`` (in the loader's
  worker processes when ``num_workers > 0``) and :meth:`InstructionFormat.collate`
  pads or packs each batch;
- Ray Data: ``dataset.map_batches(fmt)`` tokenizes in Ray Data's tasks and gives
  rows of ``max_length`` tokens (padded, or packed within each map batch), whose
  columns the trainers hand to the model as ``model(**batch)``;
- ``datasets.Dataset.map(fmt, batched=True, remove_columns=...)``: the same rows,
  stored with the data set.

The training step never sees text or a tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.hf.data.encoding import encode_pair, load_tokenizer, pad_token_id, tokenize_example
from polytrain.hf.data.rows import Encoded, pack_rows, pad_rows
from polytrain.hf.data.templates import Template

__all__ = ["InstructionDataset", "InstructionFormat", "instruction_loader"]


@dataclass
class InstructionFormat:
    """How examples become training rows: template, tokenizer, length, masking, packing.

    Example:
        >>> fmt = InstructionFormat(
        ...     tokenizer="out/tokenizer",
        ...     template=PromptTemplate("Q: {question}\\nA: ", "{answer}"),
        ...     max_length=256, pack=True)
        >>> loader = instruction_loader(datasets.load_from_disk("data/train"), fmt, batch_size=8)
        >>> ray_rows = ray.data.from_huggingface(hf_dataset).map_batches(fmt)

    Args:
        tokenizer: a directory that ``save_pretrained`` wrote (loaded lazily, once per
            process: nothing is downloaded), or a tokenizer object.
        template: a :class:`~polytrain.hf.data.templates.PromptTemplate`, a
            :class:`~polytrain.hf.data.templates.ChatTemplate`, or a function
            ``example -> (prompt, response)``.
        max_length: tokens per example at most (longer ones lose the end of their
            response) and, when packing or on Ray Data, the length of every row.
        mask_prompt: label the prompt ``-100`` (trained on the response only); False
            trains on every token.
        pack: put several examples in one row (see :mod:`polytrain.hf.data.rows`:
            positions restart per example, attention stays within it).
        add_eos: end the response with the tokenizer's EOS (None: yes, except under a
            ``ChatTemplate``, whose text ends the turn).
    """

    tokenizer: Any
    template: Template
    max_length: int
    mask_prompt: bool = True
    pack: bool = False
    add_eos: bool | None = None
    _loaded: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int):
            raise ConfigTypeError(
                f"max_length must be an int (tokens per row); got "
                f"{type(self.max_length).__name__}: {self.max_length!r}."
            )
        if self.max_length < 2:
            raise ConfigError(
                f"max_length must be >= 2 (a prompt token and a trained one); got "
                f"{self.max_length}."
            )
        for name in ("mask_prompt", "pack"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"{name} must be True or False; got {getattr(self, name)!r}.")
        if self.add_eos is not None and not isinstance(self.add_eos, bool):
            raise ConfigTypeError(f"add_eos must be True, False or None; got {self.add_eos!r}.")
        if not callable(self.template) and not hasattr(self.template, "split"):
            raise ConfigTypeError(
                f"template must be a PromptTemplate, a ChatTemplate or a function example -> "
                f"(prompt, response); got {type(self.template).__name__}."
            )

    # The loaded tokenizer stays out of pickles: every process loads its own copy.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loaded"] = None
        return state

    @property
    def loaded_tokenizer(self) -> Any:
        """The tokenizer object (loaded from its directory at the first use in a process)."""
        if self._loaded is None:
            self._loaded = load_tokenizer(self.tokenizer)
        return self._loaded

    def encode(self, example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one example (see :func:`~polytrain.hf.data.encoding.encode_pair`)."""
        tokenizer = self.loaded_tokenizer
        prompt_ids, response_ids = tokenize_example(example, tokenizer, self.template, self.add_eos)
        return encode_pair(prompt_ids, response_ids, self.max_length, self.mask_prompt)

    def rows(self, encoded: Sequence[Encoded], fixed_length: bool = True) -> dict[str, np.ndarray]:
        """Rows of encoded examples: packed into rows of ``max_length``, or one per row
        padded to ``max_length`` (``fixed_length``) or to the longest example."""
        pad_id = pad_token_id(self.loaded_tokenizer)
        if self.pack:
            return pack_rows(encoded, self.max_length, pad_id)
        return pad_rows(encoded, self.max_length if fixed_length else None, pad_id)

    def collate(self, encoded: Sequence[Encoded]) -> dict[str, Any]:
        """A ``DataLoader``'s ``collate_fn``: a batch of encoded examples as tensors.

        Unpacked batches are padded to their longest example; packed ones fill rows
        of ``max_length`` (a batch of ``n`` examples may make fewer rows) and carry
        ``use_cache=False``, without which a model attends across the examples.
        """
        rows = self.rows(encoded, fixed_length=False)
        batch: dict[str, Any] = {key: torch.from_numpy(value) for key, value in rows.items()}
        if self.pack:
            batch["use_cache"] = False
        return batch

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Columns of examples to columns of rows of ``max_length`` tokens.

        For Ray Data's ``map_batches`` (numpy or pandas batches) and ``datasets``'
        ``map(batched=True)`` (lists): the example columns go in, only the rows'
        columns come out (packing changes the row count).
        """
        columns = {key: list(values) for key, values in _columns(batch).items()}
        count = len(next(iter(columns.values()), []))
        examples = [{key: values[i] for key, values in columns.items()} for i in range(count)]
        return self.rows([self.encode(example) for example in examples])


def _columns(batch: Any) -> Mapping[str, Any]:
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
        return {column: batch[column].tolist() for column in batch.columns}
    if not isinstance(batch, Mapping):
        raise ConfigTypeError(
            f"InstructionFormat takes a batch of columns (a dict of arrays or lists, or a "
            f"pandas DataFrame); got {type(batch).__name__}."
        )
    return batch


class InstructionDataset(torch.utils.data.Dataset):
    """Examples, tokenized one by one as the loader asks for them (in its worker processes).

    Args:
        examples: anything with ``len`` and ``[i]`` giving a mapping of columns (an HF
            ``datasets.Dataset``, a list of dicts).
        fmt: the :class:`InstructionFormat`.
    """

    def __init__(self, examples: Any, fmt: InstructionFormat) -> None:
        if not hasattr(examples, "__len__") or not hasattr(examples, "__getitem__"):
            raise ConfigTypeError(
                f"examples must be indexable (a datasets.Dataset, a list of dicts); got "
                f"{type(examples).__name__}. For a DatasetDict pick a split: data['train']."
            )
        self.examples = examples
        self.fmt = fmt

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return self.fmt.encode(self.examples[index])


def instruction_loader(
    examples: Any, fmt: InstructionFormat, batch_size: int, **loader_kwargs: Any
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` of instruction batches (``batch_size`` examples each).

    Args:
        examples: see :class:`InstructionDataset`.
        fmt: the :class:`InstructionFormat`.
        batch_size: examples per batch (per worker in a ``data_creator``, where
            ``config["batch_size"]`` already is the per-worker share).
        **loader_kwargs: the ``DataLoader``'s other arguments (``shuffle``,
            ``num_workers``, ``drop_last``, ...); not ``collate_fn``.

    Raises:
        ConfigError: a ``collate_fn`` among ``loader_kwargs``.
    """
    if "collate_fn" in loader_kwargs:
        raise ConfigError(
            "instruction_loader makes its own collate_fn (InstructionFormat.collate); build "
            "the DataLoader yourself over InstructionDataset to use another one."
        )
    dataset = InstructionDataset(examples, fmt)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, collate_fn=fmt.collate, **loader_kwargs
    )
