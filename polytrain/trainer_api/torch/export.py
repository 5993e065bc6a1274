"""``TorchTrainer.save_pretrained``, worker side: the model in the HF or PEFT layout, written from the shards.

Every rank writes the model's tensors it holds (its shards under fairscale,
fsdp and deepspeed; its share of the replicated tensors under ddp and horovod;
no optimizer state) into a temporary checkpoint directory, exactly as a
checkpoint is written; rank 0 commits it, then reads it back one tensor or shard
file at a time and writes the export. No tensor reaches the driver, and no
process holds more than its own shards plus one output shard.

What is written follows the model (:func:`_plan`):

* a ``transformers`` model: its weights and config in HF's layout
  (:func:`polytrain.checkpoint.safetensors_export.write_pretrained`);
* a ``peft`` model: its adapter in PEFT's layout (only the adapter's tensors leave
  the ranks), or with ``merge=True`` the model merged into its base in HF's layout
  (:mod:`polytrain.hf.export`);
* anything that ``from_pretrained`` would load wrongly (a module that carries an HF
  config but is no ``transformers`` model, ``merge=True`` without adapters) is
  refused on every rank before anything is written, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polytrain.backends.core.local_state import local_state
from polytrain.checkpoint import safetensors_export
from polytrain.checkpoint.directory import DirReader, SaveRequest
from polytrain.checkpoint.layout import open_checkpoint
from polytrain.errors import ConfigError, PolytrainError
from polytrain.hf import export as hf_export
from polytrain.trainer_api.checkpointing.worker_writer import save_local_state, writer
from polytrain.trainer_api.torch import checkpoint as checkpoint_torch


@dataclasses.dataclass
class ExportRequest:
    """Driver -> workers: export the model.

    Attributes:
        state: where the workers write the model's tensors first (a fresh directory every
            worker sees; the driver deletes it afterwards).
        path: the export directory, as rank 0 sees it.
        max_shard_size: bytes per safetensors file, or a string such as ``"5GB"``.
        model_index: which model of the trainer (``model_creator`` may return several).
        merge: a PEFT model merged into its base (HF's layout) instead of its adapter.
    """

    state: SaveRequest
    path: str
    max_shard_size: int | str = safetensors_export.DEFAULT_MAX_SHARD_SIZE
    model_index: int = 0
    merge: bool = False


def _plan(infos: list[dict[str, Any]], request: ExportRequest) -> tuple[str, set[str] | None]:
    """``(kind, the model keys to write or None for all)``: "full", "adapter" or "merged".

    Raises:
        ConfigError: ``model_index`` out of range, or ``merge=True`` for a model without adapters.
    """
    index = request.model_index
    if not 0 <= index < len(infos):
        raise ConfigError(
            f"model_index={index} is out of range: the trainer has {len(infos)} model(s) "
            f"(use 0..{len(infos) - 1})."
        )
    info = infos[index]
    if request.merge:
        hf_export.peft_section(info, "save_pretrained(merge=True)")
        return "merged", None
    if info.get("peft"):
        return "adapter", set(info["peft"]["keys"])
    return "full", None


def save_pretrained_operator(operator: Any, request: ExportRequest) -> dict[str, Any] | None:
    """Worker (every rank; may be collective): write the model's shards; rank 0 then writes the export.

    Returns:
        Rank 0: ``{"path", "files", "total_size", ...}``, or ``{"error": message}`` when the
        export was refused or failed; None on the other ranks.
    """
    ctx = operator.context
    writer().wait()  # a sharded gather must not race a background checkpoint write
    try:  # every rank decides alike, before anything is written
        infos = checkpoint_torch.export_infos(operator, strict=True)
        kind, keys = _plan(infos, request)
    except PolytrainError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"} if ctx.world_rank == 0 else None
    state = request.state
    state = dataclasses.replace(
        state, asynchronous=False, header={**state.header, "global_step": operator.global_step}
    )
    local = local_state(operator.strategy, operator.components, ctx)
    index = request.model_index
    local.pieces = [
        p
        for p in local.pieces
        if p.path[:2] == ("models", index) and (keys is None or p.path[2] in keys)
    ]
    meta = None
    if ctx.world_rank == 0:
        models = (local.skeleton or {}).get("models") or []
        meta = {
            **checkpoint_torch.envelope(state.header),
            "models": models,
            "optimizers": [],
            safetensors_export.META_KEY: infos,
        }
    save_local_state(state, ctx.world_rank, ctx.world_size, local, meta)
    if ctx.world_rank != 0:
        return None
    try:
        return _write_from_directory(state.url, request, kind, infos[index])
    except (PolytrainError, OSError) as exc:
        # Reported to the driver as data: a refused export must not end the training run.
        return {"error": f"{type(exc).__name__}: {exc}"}


def _write_from_directory(
    url: str, request: ExportRequest, kind: str, info: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0: the export, read from the model directory the ranks just wrote (and rank 0 committed)."""
    checkpoint = open_checkpoint(url, framework="torch")
    with DirReader(checkpoint) as reader:
        tensors = safetensors_export.ModelTensors.from_reader(
            reader, request.model_index, info["keys"]
        )
        if kind == "adapter":
            return hf_export.write_adapter(tensors, info["peft"], request.path)
        if kind == "merged":
            return hf_export.write_merged(tensors, info, request.path, request.max_shard_size)
        return safetensors_export.write_pretrained(
            tensors, info, request.path, request.max_shard_size
        )
