"""TFTrainer workers: save to and load from checkpoint directories (the same layout as torch).

Under ``MultiWorkerMirroredStrategy`` every worker holds the same (mirrored)
weights and optimizer variables, so the arrays are replicated: each worker
writes its share of them (the writer spreads whole arrays over the workers),
and every worker reads the whole state back. Everything here is numpy and
JSON (``meta.json``): TensorFlow workers never import torch. A TF checkpoint
directory converts to the consolidated file ``TFTrainer.save()`` writes, and back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.layout import open_checkpoint
from polytrain.checkpoint.pieces import LocalState, Piece, assemble
from polytrain.compat.keras import optimizer_weights
from polytrain.trainer_api.checkpointing.worker_writer import save_local_state, writer


def _worker() -> Any:
    from polytrain.trainer_api.tensorflow import worker as tf_worker

    return tf_worker._state()  # the worker's strategy, components and context


def _pieces(kind: str, arrays: list[Any]) -> list[Piece]:
    pieces = []
    for index, array in enumerate(arrays):
        array = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        pieces.append(Piece((kind, 0, index), tuple(array.shape), array.reshape(-1), 0, True))
    return pieces


def save_dir(request: Any) -> dict[str, Any]:
    """Worker entry point: write this worker's share of the model and optimizer variables."""

    state = _worker()
    ctx = state.context
    model = state.model
    weights = model.get_weights()
    variables = optimizer_weights(model.optimizer)
    local = LocalState(
        pieces=_pieces("models", weights) + _pieces("optimizers", variables or []),
        skeleton=None,
    )
    meta = None
    if ctx.world_rank == 0:
        header = request.header
        meta = {
            "format": ckpt.FORMAT,
            "version": ckpt.VERSION,
            "framework": header["framework"],
            "backend": header.get("backend"),
            "world_size": header.get("world_size"),
            "epoch": header["epoch"],
            "models": [[None] * len(weights)],
            "optimizers": [None if variables is None else [None] * len(variables)],
            **request.extra,
        }
    return save_local_state(
        request, ctx.world_rank, ctx.world_size, local, meta, meta_format="json"
    )


def load_dir(url: str) -> dict[str, Any]:
    """Worker entry point: read the whole directory and load weights and optimizer variables.

    Raises:
        CheckpointError: not a committed TensorFlow checkpoint directory.
    """
    from polytrain.checkpoint.directory import DirReader

    writer().wait()
    checkpoint = open_checkpoint(url, framework="tensorflow")
    with DirReader(checkpoint, numpy=True) as reader:
        tensors = assemble(reader.skeleton, reader, reader.paths())
    payload = {"models": tensors["models"], "optimizers": tensors["optimizers"]}
    state = _worker()
    state.strategy.load_full_state_dict(state.components, payload, state.context)
    return {
        "epoch": int(checkpoint.meta["epoch"]),
        "epoch_step": int(checkpoint.meta.get("epoch_step", 0)),
    }
