"""``TorchTrainer.save_pretrained``, worker side: the model in the HF layout, written from the shards.

Every rank writes the model's tensors it holds (its shards under fairscale,
fsdp and deepspeed; its share of the replicated tensors under ddp and horovod;
no optimizer state) into a temporary checkpoint directory, exactly as a
checkpoint is written; rank 0 commits it, then reads it back one shard file at
a time and writes the safetensors files
(:func:`polytrain.checkpoint.safetensors_export.write_pretrained`). No tensor
reaches the driver, and no process holds more than its own shards plus one
output shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polytrain.backends.core.local_state import local_state
from polytrain.checkpoint import safetensors_export
from polytrain.checkpoint.directory import DirReader, SaveRequest
from polytrain.checkpoint.layout import open_checkpoint
from polytrain.errors import ConfigError, PolytrainError
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
    """

    state: SaveRequest
    path: str
    max_shard_size: int | str = safetensors_export.DEFAULT_MAX_SHARD_SIZE
    model_index: int = 0


def save_pretrained_operator(operator: Any, request: ExportRequest) -> dict[str, Any] | None:
    """Worker (every rank; may be collective): write the model's shards; rank 0 then writes the export.

    Returns:
        Rank 0: ``{"path", "files", "sharded", "total_size"}``, or ``{"error": message}``
        when the export was refused or failed; None on the other ranks.
    """
    ctx = operator.context
    writer().wait()  # a sharded gather must not race a background checkpoint write
    state = request.state
    state = dataclasses.replace(
        state, asynchronous=False, header={**state.header, "global_step": operator.global_step}
    )
    local = local_state(operator.strategy, operator.components, ctx)
    local.pieces = [p for p in local.pieces if p.path[0] == "models"]
    meta = None
    if ctx.world_rank == 0:
        models = (local.skeleton or {}).get("models") or []
        meta = {
            **checkpoint_torch.envelope(state.header),
            "models": models,
            "optimizers": [],
            safetensors_export.META_KEY: checkpoint_torch.export_infos(operator, strict=True),
        }
    save_local_state(state, ctx.world_rank, ctx.world_size, local, meta)
    if ctx.world_rank != 0:
        return None
    try:
        return _write_from_directory(state.url, request)
    except (PolytrainError, OSError) as exc:
        # Reported to the driver as data: a refused export must not end the training run.
        return {"error": f"{type(exc).__name__}: {exc}"}


def _write_from_directory(url: str, request: ExportRequest) -> dict[str, Any]:
    """Rank 0: the export, read from the model directory the ranks just wrote (and rank 0 committed)."""
    checkpoint = open_checkpoint(url, framework="torch")
    infos = checkpoint.meta.get(safetensors_export.META_KEY) or []
    index = request.model_index
    if not 0 <= index < len(infos):
        raise ConfigError(
            f"model_index={index} is out of range: the trainer has {len(infos)} model(s) "
            f"(use 0..{len(infos) - 1})."
        )
    with DirReader(checkpoint) as reader:
        tensors = safetensors_export.ModelTensors.from_reader(reader, index, infos[index]["keys"])
        return safetensors_export.write_pretrained(
            tensors, infos[index], request.path, request.max_shard_size
        )
