"""Consolidated checkpoint state of the ``fairscale`` backend (worker side).

fairscale keeps optimizer state in two sharded forms: ``OSS`` partitions it over
the ranks (modes "oss" and "sddp"), and fairscale's ``FullyShardedDataParallel``
holds it per flat parameter (mode "fsdp"). These functions gather either form
into torch's own ``optimizer.state_dict()`` format (integer keys in param-group
order), so a state saved here loads into a plain torch optimizer of the same
class, and give each rank its shard of such a state back.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.backends.core import sharding as _sharding
from polytrain.backends.core.context import Components
from polytrain.backends.fairscale import common
from polytrain.checkpoint.pieces import (
    LocalState,
    Piece,
    ShardReader,
    load_whole_model,
    local_optimizer_state,
    model_pieces,
    optimizer_pieces,
    optimizer_skeleton,
    whole_piece,
)


def consolidate_oss_states(optimizers: list[Any], rank: int) -> list[dict[str, Any]]:
    """Worker (every rank, collective): the full states of ``OSS`` optimizers, on rank 0.

    Args:
        optimizers: fairscale ``OSS`` optimizers.
        rank: this worker's world rank.

    Returns:
        Torch-format states on rank 0; an empty list on the other ranks.
    """
    states = []
    for optimizer in optimizers:
        optimizer.consolidate_state_dict(recipient_rank=0)
        if rank == 0:
            states.append(torch_format(optimizer.state_dict()))
            # OSS keeps every rank's shard on rank 0 until the next consolidation:
            # drop them, or rank 0 holds the whole optimizer state from now on.
            optimizer._all_states = []
    return states


def gather_fsdp_states(owned: list[tuple[Any, torch.nn.Module | None]]) -> list[Any]:
    """Worker (every rank, collective): the full optimizer states under fairscale's FSDP.

    Args:
        owned: ``(optimizer, its model or None)`` pairs.

    Returns:
        One torch-format state per optimizer on rank 0 (``None`` on the other ranks
        for optimizers of FSDP models).
    """
    from fairscale.nn import FullyShardedDataParallel

    states = []
    for optimizer, model in owned:
        if isinstance(model, FullyShardedDataParallel):
            full = model.gather_full_optim_state_dict(optimizer)  # rank 0 gets it
            states.append(torch_format(full) if full is not None else None)
        else:
            states.append(optimizer.state_dict())
    return states


def load_optimizer_shard(
    optimizer: Any, model: torch.nn.Module | None, state: dict[str, Any], fsdp_mode: bool
) -> None:
    """Worker (every rank): load this rank's shard of a torch-format optimizer state.

    Args:
        optimizer: an ``OSS`` optimizer, or one over fairscale FSDP's flat parameters.
        model: the optimizer's (wrapped) model, or None.
        state: the full torch-format state (shared by every optimizer of the checkpoint:
            it is not modified).
        fsdp_mode: True in fairscale mode "fsdp".
    """
    if fsdp_mode and hasattr(model, "get_shard_from_optim_state_dict"):
        full = fsdp_shard_format(model, state)
        optimizer.load_state_dict(model.get_shard_from_optim_state_dict(full))
        return
    # OSS.load_state_dict blanks the entries other ranks own in the dict it is
    # given: hand it a copy, not the shared checkpoint.
    optimizer.load_state_dict(
        {"state": dict(state["state"]), "param_groups": state["param_groups"]}
    )
    # OSS's outer state is only read by state_dict() and is overwritten there by
    # the consolidated shards; keeping it would pin this rank to the full state.
    optimizer.state.clear()


def torch_format(state: dict[str, Any]) -> dict[str, Any]:
    """Check that a consolidated fairscale state has torch's layout, and return it as a plain dict.

    Raises:
        RuntimeError: the keys are not torch's param indices (a fairscale change).
    """
    indices = [i for group in state["param_groups"] for i in group["params"]]
    if indices != list(range(len(indices))) or not set(state["state"]) <= set(indices):
        raise RuntimeError(
            "fairscale's consolidated optimizer state is not keyed by parameter index as "
            f"torch's is (param-group indices {indices[:8]}..., state keys "
            f"{list(state['state'])[:8]}...); this fairscale version is not supported."
        )
    return {
        "state": {
            index: {
                # fairscale's FSDP counts steps in ints; torch keeps float tensors
                k: torch.tensor(float(v)) if k == "step" and isinstance(v, int) else v
                for k, v in param_state.items()
            }
            for index, param_state in state["state"].items()
        },
        "param_groups": [dict(group) for group in state["param_groups"]],
    }


def fsdp_shard_format(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A torch-format full optimizer state with the bookkeeping fairscale's FSDP shards from.

    ``param_id_map`` maps each unflattened parameter index to the FSDP instance whose
    flat parameter holds it, as ``gather_full_optim_state_dict`` writes it.
    """
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import get_fsdp_instances

    param_id_map = {}
    for local_id, instance in enumerate(get_fsdp_instances(model, skip_empty=True)):
        for _ in range(instance.num_params_managed):
            param_id_map[len(param_id_map)] = local_id
    return {
        "state": {k: dict(v) for k, v in state["state"].items()},
        "param_groups": [dict(group) for group in state["param_groups"]],
        "param_id_map": param_id_map,
        "uncollected_local_ids": [],
    }


# ----------------------------------------------------------- sharded checkpoints
def oss_local_state(strategy: Any, components: Any, ctx: Any) -> LocalState:
    """Worker: the models (replicated) and this rank's OSS optimizer shard, as they are (no gather).

    OSS keeps the whole state of the parameters a rank owns (``optimizer.optim``);
    each such tensor is a whole-tensor piece only its owner writes.
    """
    pieces: list[Piece] = []
    model_skeletons = []
    for index, model in enumerate(components.models):
        state = strategy.unwrap_model(model).state_dict()
        pieces += model_pieces(index, state, replicated=True)
        model_skeletons.append({k: v for k, v in state.items() if not torch.is_tensor(v)})
    for index, optimizer in enumerate(components.optimizers):
        inner = getattr(optimizer, "optim", None)
        if inner is None:  # not an OSS optimizer: a full, replicated copy
            pieces += optimizer_pieces(index, optimizer.state_dict(), replicated=True)
            continue
        position = {id(p): i for i, p in enumerate(_params(optimizer))}
        for param, state in inner.state.items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    path = ("optimizers", index, "state", position[id(param)], key)
                    pieces.append(whole_piece(path, value, replicated=False))
    skeleton = None
    if ctx.world_rank == 0:
        skeleton = {
            "models": model_skeletons,
            "optimizers": [optimizer_skeleton(o.param_groups) for o in components.optimizers],
        }
    return LocalState(pieces=pieces, skeleton=skeleton)


def oss_load(strategy: Any, components: Any, reader: ShardReader) -> None:
    """Worker: load the models whole and, into each OSS optimizer, only the state this rank owns."""
    for index, model in enumerate(components.models):
        load_whole_model(strategy.unwrap_model(model), reader, index)
    for index, optimizer in enumerate(components.optimizers):
        params = _params(optimizer)
        owner = getattr(optimizer, "_param_to_rank", None)
        wanted = {
            i: None
            for i, param in enumerate(params)
            if owner is None or owner[param] == optimizer.rank
        }
        state = local_optimizer_state(reader, index, wanted)
        if state is None:
            continue
        optimizer.load_state_dict(state)
        if owner is not None:
            # OSS also fills its outer state; only the inner optimizer's is used.
            optimizer.state.clear()


def _params(optimizer: Any) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def load_full_state(
    components: Components, state: dict[str, Any], targets: list[torch.nn.Module], fsdp_mode: bool
) -> None:
    """Worker (every rank): a consolidated torch-format state into ``targets`` and the sharded optimizers.

    Args:
        components: the strategy's components (its optimizers and their owners).
        state: ``{"models": [...], "optimizers": [...]}`` as ``full_state_dict`` returns it.
        targets: the modules the model states load into (unwrapped, or FSDP's own).
        fsdp_mode: True in fairscale mode "fsdp".
    """
    for model, model_state in zip(targets, state["models"], strict=True):
        model.load_state_dict(model_state)
    states = _sharding.portable_optimizer_states(state.get("optimizers"))
    if states is None:
        return
    for (optimizer, model), optimizer_state in zip(common.owned(components), states, strict=True):
        if optimizer_state is not None:
            load_optimizer_shard(optimizer, model, optimizer_state, fsdp_mode)
