"""Fine-tuning pretrained Hugging Face models: weights in, PEFT adapters, HF / PEFT export.

* :func:`from_pretrained` / :func:`pretrained`: an HF checkpoint directory in a
  ``model_creator``; on the workers each rank reads only the part of every tensor
  it keeps, straight from the safetensors files (:mod:`polytrain.hf.loading`,
  :mod:`polytrain.hf.weights`).

Importing this package imports neither ``transformers`` nor ``peft``.
"""

from polytrain.hf.loading import Pretrained, from_pretrained, pretrained

__all__ = ["Pretrained", "from_pretrained", "pretrained"]
