"""Tensor-parallel plans: built in for HF Llama-style models and GPT-2, or the user's ``tp_plan=``.

A plan says how each module of the model is split over the TP ranks of a node
(torch's ``parallelize_module``). It runs on every worker before activation
checkpointing, ``compile`` and ``fully_shard``, as torchtitan orders them.

* Llama-style decoders (``LlamaForCausalLM`` and the models shaped like it: a
  ``model.layers`` stack of ``self_attn.{q,k,v,o}_proj`` and
  ``mlp.{gate,up,down}_proj`` with ``input_layernorm`` / ``post_attention_layernorm``,
  ``model.embed_tokens``, ``model.norm``, ``lm_head``): torchtitan's Llama plan. q,
  k, v, gate and up are column-parallel, o and down row-parallel; the RMSNorms run
  sequence parallel (each rank normalises its part of the sequence, so the
  activations between the blocks are split too); the embedding is split by
  vocabulary and the LM head's outputs gathered, so the loss is the usual one.
* GPT-2 (``transformer.h`` blocks of HF ``Conv1D``): the attention's fused
  ``c_attn`` split by heads of q, k and v, ``c_proj`` row-parallel, the MLP's
  ``c_fc`` / ``c_proj`` column / row (:mod:`polytrain.backends.fsdp.tp_styles`).
  Embeddings, LayerNorms and the (tied) LM head stay whole on every TP rank.
* ``tp_plan=``: ``{module name pattern: style}`` for any other model, where a style
  is a torch ``ParallelStyle`` or one of :data:`STYLE_NAMES`; patterns are
  ``parallelize_module``'s (``"layers.*.attn.q"``).

Parameters keep their names and global shapes: checkpoints and exports are
those of the unsharded model. Weights are not moved between ranks here
(``src_data_rank=None``): every rank already holds the same weights (rank 0's,
broadcast before, or loaded after sharding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from polytrain.backends.core.parallelism import refuse_adapters_under_tp
from polytrain.errors import ConfigError, ConfigTypeError

#: The style names a ``tp_plan`` may use (YAML run configs name them).
STYLE_NAMES = (
    "colwise",
    "rowwise",
    "sequence_parallel",
    "conv1d_colwise",
    "conv1d_rowwise",
    "conv1d_colwise_qkv",
)

_LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def check_tp_plan(value: Any) -> dict[str, Any] | None:
    """Driver: ``tp_plan`` as a dict of patterns to styles (names checked), or None.

    Raises:
        ConfigTypeError: not a mapping, or a pattern that is not a string.
        ConfigError: an unknown style name.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ConfigTypeError(
            f"tp_plan must be a non-empty dict of module name patterns to styles, e.g. "
            f'{{"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}}; got '
            f"{type(value).__name__}: {value!r}."
        )
    for pattern, style in value.items():
        if not isinstance(pattern, str):
            raise ConfigTypeError(f"tp_plan keys are module name patterns (str); got {pattern!r}.")
        if isinstance(style, str) and style not in STYLE_NAMES:
            raise ConfigError(
                f"tp_plan[{pattern!r}]={style!r} is not a known style. Use one of "
                f"{', '.join(repr(s) for s in STYLE_NAMES)} or a torch ParallelStyle instance."
            )
        if not isinstance(style, str) and not _is_style(style):
            raise ConfigTypeError(
                f"tp_plan[{pattern!r}] must be a style name or a torch ParallelStyle; got "
                f"{type(style).__name__}: {style!r}."
            )
    return dict(value)


def _is_style(value: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


def style(value: Any) -> Any:
    """A fresh ``ParallelStyle`` for a style name; a style instance as it is."""
    if not isinstance(value, str):
        return value
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    from polytrain.backends.fsdp.tp_styles import Conv1DColwise, Conv1DRowwise

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence_parallel": SequenceParallel,
        "conv1d_colwise": Conv1DColwise,
        "conv1d_rowwise": Conv1DRowwise,
        "conv1d_colwise_qkv": lambda: Conv1DColwise(fused=3),
    }[value]()


def plan_name(model: torch.nn.Module, tp_plan: dict[str, Any] | None, tp: int) -> str:
    """The plan ``model`` gets: "tp_plan" (the user's), "llama" or "gpt2", after its checks.

    Raises:
        ConfigError: no ``tp_plan`` and no built-in plan fits the model, or its head
            counts are not divisible by ``tp``.
    """
    config = getattr(model, "config", None)
    if tp_plan is not None:
        return "tp_plan"
    if _llama_decoder(model) is not None:
        check_heads(model, "num_attention_heads", getattr(config, "num_attention_heads", None), tp)
        check_heads(model, "num_key_value_heads", getattr(config, "num_key_value_heads", None), tp)
        return "llama"
    if _gpt2_blocks(model) is not None:
        check_heads(model, "n_head", getattr(config, "n_head", None), tp)
        return "gpt2"
    raise ConfigError(
        f"parallelism tp={tp} needs a tensor-parallel plan for {type(model).__name__}: "
        f"polytrain has built-in plans for HF Llama-style models (LlamaForCausalLM, Mistral, "
        f"Qwen2: model.layers of self_attn.q/k/v/o_proj and mlp.gate/up/down_proj) and GPT-2 "
        f"(transformer.h blocks). Pass tp_plan={{module name pattern: style}} (styles: "
        f"{', '.join(STYLE_NAMES)} or torch ParallelStyles), or set tp=1."
    )


def apply_tp_plan(model: torch.nn.Module, tp_mesh: Any, tp_plan: dict[str, Any] | None) -> str:
    """Split ``model`` over ``tp_mesh`` in place; returns the plan's name (:func:`plan_name`).

    Raises:
        ConfigError: as :func:`plan_name`, or a model with PEFT adapters
            (:func:`~polytrain.backends.core.parallelism.refuse_adapters_under_tp`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    refuse_adapters_under_tp(model, tp_mesh.size())
    name = plan_name(model, tp_plan, tp_mesh.size())
    if name == "tp_plan":
        plan = {pattern: style(value) for pattern, value in tp_plan.items()}
        parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    elif name == "llama":
        _parallelize_llama(model, tp_mesh)
    else:
        _parallelize_gpt2(model, tp_mesh)
    return name


def check_heads(model: torch.nn.Module, name: str, heads: Any, tp: int) -> None:
    """Raises ConfigError when ``heads`` (a head count from the model's config) is not divisible by ``tp``."""
    if heads is not None and int(heads) % tp:
        raise ConfigError(
            f"parallelism tp={tp} splits attention heads between the TP ranks, but "
            f"{type(model).__name__} has {name}={heads}, which is not divisible by {tp}. "
            f"Choose a tp that divides {heads}."
        )


# ------------------------------------------------------------------- Llama
def _llama_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    decoder = getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return None
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "norm")):
        return None
    layer = layers[0]
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        return None
    names = [*(f"self_attn.{n}" for n in _LLAMA_ATTENTION), *(f"mlp.{n}" for n in _LLAMA_MLP)]
    names += ["input_layernorm", "post_attention_layernorm"]
    return decoder if len(_present(layer, names)) == len(names) else None


def _present(module: torch.nn.Module, names: list[str]) -> list[str]:
    found = []
    for name in names:
        try:
            module.get_submodule(name)
        except AttributeError:
            continue
        found.append(name)
    return found


def _llama_layer_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # Between the blocks the activations are split by sequence (Shard(1)) and stay
    # DTensors, so the residual adds and HF's sequence-length reads see the whole shape.
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        **{f"self_attn.{n}": ColwiseParallel() for n in _LLAMA_ATTENTION[:3]},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _parallelize_llama(model: torch.nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    decoder = _llama_decoder(model)
    head = getattr(model, "lm_head", None) if decoder is not model else None
    tied = head is not None and head.weight is decoder.embed_tokens.weight
    top = {
        "embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
    }
    parallelize_module(decoder, tp_mesh, top, src_data_rank=None)
    if head is not None:
        # The logits gathered whole on every TP rank: the loss is the model's own.
        output = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        parallelize_module(head, tp_mesh, output, src_data_rank=None)
        if tied:  # both split by vocabulary rows (Shard(0)): one parameter again
            head.weight = decoder.embed_tokens.weight
    for layer in decoder.layers:
        parallelize_module(layer, tp_mesh, _llama_layer_plan(), src_data_rank=None)


# ------------------------------------------------------------------- GPT-2
def _gpt2_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    transformer = getattr(model, "transformer", model)
    blocks = getattr(transformer, "h", None)
    if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        return None
    names = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    if len(_present(blocks[0], names)) != len(names):
        return None
    conv = blocks[0].get_submodule("attn.c_attn")
    # HF's Conv1D: weight (in, out) and an ``nf`` output size; anything else is not GPT-2's.
    return blocks if hasattr(conv, "nf") and conv.weight.dim() == 2 else None


def _parallelize_gpt2(model: torch.nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from polytrain.backends.fsdp.tp_styles import Conv1DColwise, Conv1DRowwise

    blocks = _gpt2_blocks(model)
    tp = tp_mesh.size()
    for block in blocks:
        plan = {
            "attn.c_attn": Conv1DColwise(fused=3),
            "attn.c_proj": Conv1DRowwise(),
            "mlp.c_fc": Conv1DColwise(),
            "mlp.c_proj": Conv1DRowwise(),
        }
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)
        # GPT2Attention splits c_attn's output into q, k, v of ``split_size`` each: now local.
        block.attn.split_size //= tp
