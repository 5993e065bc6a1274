"""Instruction data: prompts masked out of the loss, optional packing, token-exact losses.

>>> from polytrain.hf.data import InstructionFormat, PromptTemplate, TokenMeanOperator, instruction_loader
>>> fmt = InstructionFormat(tokenizer="out/tokenizer", max_length=256, pack=True,
...                         template=PromptTemplate("Q: {question}\\nA: ", "{answer}"))
>>> def data_creator(config):
...     return instruction_loader(datasets.load_from_disk("data/train"), fmt, config["batch_size"])
>>> TorchTrainer(..., data_creator=data_creator, training_operator_cls=TokenMeanOperator)

The tokenizer runs on the data side (the loader's workers, Ray Data's
``map_batches``), never in the training step. See docs/instruction-data.md.
"""

from polytrain.hf.data.encoding import IGNORE_INDEX, encode_pair, load_tokenizer
from polytrain.hf.data.pipeline import InstructionDataset, InstructionFormat, instruction_loader
from polytrain.hf.data.rows import pack_rows, pad_rows
from polytrain.hf.data.templates import ChatTemplate, PromptTemplate, TemplateError
from polytrain.hf.data.token_mean import TokenMeanOperator, step_token_count, sum_over_workers

__all__ = [
    "IGNORE_INDEX",
    "ChatTemplate",
    "InstructionDataset",
    "InstructionFormat",
    "PromptTemplate",
    "TemplateError",
    "TokenMeanOperator",
    "encode_pair",
    "instruction_loader",
    "load_tokenizer",
    "pack_rows",
    "pad_rows",
    "step_token_count",
    "sum_over_workers",
]
