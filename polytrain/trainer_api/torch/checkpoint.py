"""TorchTrainer workers: save to and load from checkpoint directories.

Called on every worker with its :class:`~polytrain.trainer_api.torch.operator.TrainingOperator`
(inside the strategy's worker scope), e.g. through
``torch_worker.apply_to_operator(functools.partial(save_operator, request=...))``.
Each rank writes only what it holds (its shards under fairscale, fsdp and
deepspeed; its share of the replicated tensors under ddp and horovod) and
loads only the ranges it needs, so no process ever holds the whole state.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from polytrain.backends.core.local_state import load_local_state, local_state
from polytrain.checkpoint import rng_state
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import DirReader, SaveRequest
from polytrain.checkpoint.layout import open_checkpoint, rank_file
from polytrain.checkpoint.pieces import FROZEN_KEY
from polytrain.checkpoint.safetensors_export import META_KEY
from polytrain.trainer_api.checkpointing.worker_writer import save_local_state, writer
from polytrain.trainer_api.torch import frozen
from polytrain.trainer_api.torch.model_info import export_info


def envelope(header: dict[str, Any]) -> dict[str, Any]:
    """The consolidated checkpoint's envelope (format, version, ...) from a save request's header."""
    return {
        "format": ckpt.FORMAT,
        "version": ckpt.VERSION,
        "framework": header["framework"],
        "backend": header.get("backend"),
        "world_size": header.get("world_size"),
        "epoch": header["epoch"],
    }


def trainer_state(operator: Any) -> dict[str, Any]:
    """The small, non-sharded part of a torch worker's state: schedulers, scaler, operator, step."""
    components = operator.components
    return {
        "schedulers": [s.state_dict() for s in components.schedulers],
        "scaler": components.precision.state_dict() if components.precision else None,
        "operator": operator.state_dict(),
        "global_step": operator.global_step,
    }


def export_infos(operator: Any, strict: bool = False) -> list[dict[str, Any]]:
    """Rank 0: per model, what an export in the HF layout needs (tied names, HF config files).

    ``strict``: a config that cannot be written raises (``save_pretrained``) rather
    than leaving the checkpoint without it (every other save).
    """
    return [
        export_info(operator.strategy.unwrap_model(m), strict) for m in operator.components.models
    ]


def load_trainer_state(operator: Any, state: dict[str, Any]) -> None:
    """Load what :func:`trainer_state` returned (from a checkpoint's meta or consolidated dict)."""
    components = operator.components
    for scheduler, sched_state in zip(
        components.schedulers, state.get("schedulers") or [], strict=False
    ):
        scheduler.load_state_dict(sched_state)
    if components.precision is not None:
        components.precision.load_state_dict(state.get("scaler"))
    operator.load_state_dict(state.get("operator") or {})
    operator.global_step = int(state.get("global_step", 0))


def save_operator(operator: Any, request: SaveRequest) -> dict[str, Any]:
    """Worker (every rank; may be collective): write this rank's part of a checkpoint directory.

    Returns:
        Small metadata for the driver (see
        :func:`~polytrain.trainer_api.checkpointing.worker_writer.save_local_state`).
    """
    ctx = operator.context
    request = dataclasses.replace(
        request, header={**request.header, "global_step": operator.global_step}
    )
    writer().wait()  # a sharded gather must not race the previous background write
    with operator.strategy.worker_scope(ctx):
        local = local_state(operator.strategy, operator.components, ctx)
    entries = frozen.frozen_entries(operator)
    local.pieces = frozen.without_frozen(local.pieces, entries)  # a LoRA run: no base
    meta = None
    if ctx.world_rank == 0:
        meta = {
            **envelope(request.header),
            **(local.skeleton or {"models": [], "optimizers": []}),
            **trainer_state(operator),
            META_KEY: export_infos(operator),
            **({FROZEN_KEY: entries} if any(entries) else {}),
            **request.extra,
        }
    rng = rng_state.capture()  # now, on the training thread: the state the next batch sees
    return save_local_state(request, ctx.world_rank, ctx.world_size, local, meta, rng)


def load_operator(operator: Any, url: str) -> dict[str, Any]:
    """Worker (every rank; may be collective): load a checkpoint directory, reading only what this rank holds.

    Returns:
        ``{"epoch", "epoch_step", "global_step"}`` of the checkpoint.

    Raises:
        CheckpointError: the directory is not a committed torch checkpoint.
    """
    writer().wait()
    checkpoint = open_checkpoint(url, framework="torch")
    frozen.check_loadable(checkpoint.meta, operator)
    with DirReader(checkpoint) as reader, operator.strategy.worker_scope(operator.context):
        load_local_state(operator.strategy, operator.components, reader, operator.context)
    load_trainer_state(operator, checkpoint.meta)
    operator._pending_rng_state = _saved_rng_state(checkpoint, operator.context)
    return {
        "epoch": int(checkpoint.meta["epoch"]),
        "epoch_step": int(checkpoint.meta.get("epoch_step", 0)),
        "global_step": operator.global_step,
    }


def _saved_rng_state(checkpoint: Any, ctx: Any) -> dict[str, Any] | None:
    """This rank's random states in ``checkpoint``: only when it was written at this world size."""
    if checkpoint.manifest.get("world_size") != ctx.world_size:
        return None
    index = json.loads(checkpoint.storage.read_bytes(rank_file(ctx.world_rank, "json")))
    return index.get("rng")
