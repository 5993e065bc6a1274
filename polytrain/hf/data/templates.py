"""Prompt templates: how an example becomes a prompt (not trained) and a response (trained).

A template splits one example (a mapping of columns, as an HF ``datasets`` row or
a Ray Data row gives it) into two strings. The encoder tokenizes them apart, so
the boundary between the masked prompt and the trained response is exact (no
token spans both; see :mod:`polytrain.hf.data.encoding`).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

__all__ = ["ChatTemplate", "PromptTemplate", "Template", "TemplateError", "split_example"]


class TemplateError(ConfigError):
    """An example that a template cannot render (a missing column, a chat template that is not a prefix)."""


@dataclass(frozen=True)
class PromptTemplate:
    """Format strings over the example's columns: ``prompt`` is masked, ``response`` trained.

    Example:
        >>> template = PromptTemplate(
        ...     prompt="### Instruction:\\n{instruction}\\n### Response:\\n",
        ...     response="{output}")
        >>> template.split({"instruction": "Say hi", "output": "hi"})
        ('### Instruction:\\nSay hi\\n### Response:\\n', 'hi')

    Args:
        prompt: a ``str.format`` string whose fields name columns.
        response: the same for the trained part (default: the ``response`` column).
    """

    prompt: str
    response: str = "{response}"

    def __post_init__(self) -> None:
        for name in ("prompt", "response"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigTypeError(
                    f"PromptTemplate.{name} must be a format string such as "
                    f"'{{instruction}}'; got {type(value).__name__}: {value!r}."
                )
        if not self.fields():
            raise ConfigError(
                f"PromptTemplate names no column: prompt={self.prompt!r}, "
                f"response={self.response!r}. Name columns in braces, e.g. '{{instruction}}'."
            )

    def fields(self) -> list[str]:
        """The column names the two format strings use."""
        names = []
        for text in (self.prompt, self.response):
            names += [f for _, f, _, _ in string.Formatter().parse(text) if f]
        return names

    def split(self, example: Mapping[str, Any], tokenizer: Any = None) -> tuple[str, str]:
        """``(prompt, response)`` of one example (``tokenizer`` is not used).

        Raises:
            TemplateError: the example lacks a column the template names.
        """
        missing = [name for name in self.fields() if name not in example]
        if missing:
            raise TemplateError(
                f"PromptTemplate names the columns {missing}, which the example does not have "
                f"(its columns: {sorted(example)}). Name the data set's columns in the template."
            )
        return self.prompt.format(**example), self.response.format(**example)


@dataclass(frozen=True)
class ChatTemplate:
    """The tokenizer's own chat template over a column of messages; the last one is trained.

    The prompt is every message but the last, rendered with
    ``add_generation_prompt=True``; the response is what the whole conversation adds
    to it (the last assistant message and the template's end-of-turn text). Earlier
    assistant turns are part of the prompt: masked.

    Args:
        messages: the column that holds ``[{"role": ..., "content": ...}, ...]``.
    """

    messages: str = "messages"

    def split(self, example: Mapping[str, Any], tokenizer: Any = None) -> tuple[str, str]:
        """``(prompt, response)`` of one conversation.

        Raises:
            TemplateError: no messages column, a conversation that does not end with an
                assistant message, a tokenizer without a chat template, or a template
                whose rendered prompt is not a prefix of the rendered conversation.
        """
        conversation = _messages(example, self.messages)
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(
                f"ChatTemplate needs a tokenizer with a chat_template; "
                f"{type(tokenizer).__name__} has none. Set tokenizer.chat_template or use a "
                f"PromptTemplate."
            )
        prompt = tokenizer.apply_chat_template(
            conversation[:-1], tokenize=False, add_generation_prompt=True
        )
        whole = tokenizer.apply_chat_template(conversation, tokenize=False)
        if not whole.startswith(prompt):
            raise TemplateError(
                f"The chat template renders the prompt {prompt[-80:]!r} (end shown), which does "
                f"not begin the rendered conversation {whole[: len(prompt)][-80:]!r}: the trained "
                f"part cannot be cut off exactly. Use a PromptTemplate for this model."
            )
        return prompt, whole[len(prompt) :]


def _messages(example: Mapping[str, Any], column: str) -> list[dict[str, Any]]:
    if column not in example:
        raise TemplateError(
            f"ChatTemplate reads the column {column!r}, which the example does not have (its "
            f"columns: {sorted(example)}). Pass ChatTemplate(messages=<column>)."
        )
    conversation = list(example[column])
    if not conversation or _role(conversation[-1]) != "assistant":
        last = _role(conversation[-1]) if conversation else None
        raise TemplateError(
            f"ChatTemplate trains the last message, which must be the assistant's; this "
            f"conversation ends with role {last!r} ({len(conversation)} messages)."
        )
    return [dict(message) for message in conversation]


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


#: A template: a :class:`PromptTemplate`, a :class:`ChatTemplate`, or a function
#: ``example -> (prompt, response)``.
Template = PromptTemplate | ChatTemplate | Callable[[Mapping[str, Any]], Sequence[str]]


def split_example(
    template: Template, example: Mapping[str, Any], tokenizer: Any
) -> tuple[str, str]:
    """``(prompt, response)`` of ``example`` under any kind of template.

    Raises:
        TemplateError: a function template that does not return two strings.
    """
    if isinstance(template, (PromptTemplate, ChatTemplate)):
        return template.split(example, tokenizer)
    parts = template(example)
    if (
        not isinstance(parts, (tuple, list))
        or len(parts) != 2
        or not all(isinstance(p, str) for p in parts)
    ):
        raise TemplateError(
            f"A template function must return (prompt, response), two strings; "
            f"{getattr(template, '__name__', template)!r} returned {parts!r:.120}."
        )
    return parts[0], parts[1]
