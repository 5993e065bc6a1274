"""Hugging Face models on polytrain: pretrained weights in, PEFT adapters, export, instruction data.

* :func:`from_pretrained` / :func:`pretrained`: an HF checkpoint directory in a
  ``model_creator``; on the workers each rank reads only the part of every tensor
  it keeps, straight from the safetensors files (:mod:`polytrain.hf.loading`,
  :mod:`polytrain.hf.weights`; the backends fill it in,
  :mod:`polytrain.backends.core.pretrained_fill`).
* :mod:`polytrain.hf.adapters`: the trainer's ``peft_config=``, and what an export of
  a PEFT model needs to know about it.
* :mod:`polytrain.hf.export`: a PEFT model's adapter in PEFT's layout, or merged into
  its base in HF's layout (``save_pretrained``, ``polytrain checkpoint convert``).
* :mod:`polytrain.hf.data`: instruction data (chat templates, prompt masking, packing,
  the token-mean loss); it imports ``datasets`` only where it reads a folder.

This package knows no launcher, backend or trainer; importing it imports neither
``transformers`` nor ``peft`` (nor ``torch``: its names load on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polytrain.hf.loading import Pretrained, from_pretrained, pretrained

__all__ = ["Pretrained", "from_pretrained", "pretrained"]


def __getattr__(name: str) -> Any:
    # Lazy: the creator checks import polytrain.hf.adapters, also in TFTrainer's processes,
    # which never import torch.
    if name in __all__:
        from polytrain.hf import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'polytrain.hf' has no attribute {name!r}")
