"""One example to token ids and labels: the prompt masked, the response trained.

The prompt and the response are tokenized apart and concatenated: the boundary
between them is exact (a BPE merge across it cannot hide an answer token in
the prompt, or a prompt token in the answer), and the prompt's tokens are those
the model sees when it is asked the same prompt at generation time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from polytrain.compat.imports import require
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.hf.data.templates import ChatTemplate, Template, split_example

__all__ = ["IGNORE_INDEX", "encode_pair", "load_tokenizer", "pad_token_id", "tokenize_example"]

#: The label that losses skip (torch's ``CrossEntropyLoss`` and HF models).
IGNORE_INDEX = -100


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object: ``tokenizer`` itself, or ``AutoTokenizer`` from a local directory.

    Nothing is downloaded: a path that is not a directory on this machine is refused.

    Raises:
        ConfigError: a path that is not a local directory.
    """
    if not isinstance(tokenizer, (str, os.PathLike)):
        if not callable(getattr(tokenizer, "encode", None)):
            raise ConfigTypeError(
                f"tokenizer must be a directory holding a saved tokenizer, or a tokenizer "
                f"(transformers' PreTrainedTokenizerBase); got {type(tokenizer).__name__}."
            )
        return tokenizer
    path = os.fspath(tokenizer)
    if not os.path.isdir(path):
        raise ConfigError(
            f"tokenizer={path!r} is not a directory on this machine; give the directory that "
            f"tokenizer.save_pretrained(...) wrote (nothing is downloaded)."
        )
    transformers = require("transformers", "polytrain.hf.data (tokenizers)")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills rows: the pad token, else end-of-sequence, else 0 (always masked)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def tokenize_example(
    example: Mapping[str, Any], tokenizer: Any, template: Template, add_eos: bool | None
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, response_ids)`` of one example.

    The prompt gets the tokenizer's special tokens (a BOS) unless a chat template
    rendered them already; the response gets none, and ends with the tokenizer's
    EOS when ``add_eos`` (None: yes, except under a :class:`ChatTemplate`, whose
    text ends its turn itself).

    Raises:
        ConfigError: ``add_eos`` with a tokenizer that has no EOS token.
    """
    prompt, response = split_example(template, example, tokenizer)
    chat = isinstance(template, ChatTemplate)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if add_eos if add_eos is not None else not chat:
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ConfigError(
                f"add_eos: the tokenizer {type(tokenizer).__name__} has no eos_token; set "
                f"tokenizer.eos_token, or pass add_eos=False (the model then never learns to "
                f"stop)."
            )
        response_ids.append(eos)
    return prompt_ids, response_ids


def encode_pair(
    prompt_ids: list[int], response_ids: list[int], max_length: int, mask_prompt: bool = True
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one example, cut to ``max_length`` tokens.

    ``labels`` is ``IGNORE_INDEX`` on the prompt when ``mask_prompt`` and on the
    first token always: a causal LM predicts token ``i`` from the tokens before it,
    and the first token of an example has none of its own (in a packed row the token
    before it belongs to another example). So the labels that are not
    ``IGNORE_INDEX`` are exactly the predictions the loss counts. A long example
    keeps its prompt and loses the end of its response.
    """
    ids = (prompt_ids + response_ids)[:max_length]
    if mask_prompt:
        labels = [IGNORE_INDEX] * len(prompt_ids) + list(response_ids)
    else:
        labels = list(prompt_ids + response_ids)
    labels = labels[:max_length]
    if labels:
        labels[0] = IGNORE_INDEX
    return ids, labels
