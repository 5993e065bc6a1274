"""Consolidated state of a DeepSpeed engine, to and from the backend-neutral torch form (worker side).

Checkpoints stay backend-independent: the weights are gathered into the user's
module ``state_dict`` (fp32, unsharded) and the optimizer state into plain
``torch.optim`` format, so a checkpoint written under ``deepspeed`` loads under
``ddp`` at any world size and the other way round. Gathers and loads are
collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.core.context import Components, WorkerContext
from polytrain.errors import CheckpointError

logger = logging.getLogger(__name__)

# Where the strategy keeps the engine in Components.extra.
ENGINE_KEY = "deepspeed"


@dataclass
class EngineState:
    """What the strategy keeps per worker: the engine, the user's optimizer, its param order."""

    engine: Any
    user_optimizer: torch.optim.Optimizer
    param_groups: list[list[torch.nn.Parameter]]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The user's parameters in the order of the torch-format optimizer state."""
        return [p for group in self.param_groups for p in group]

    @property
    def stage(self) -> int:
        """The engine's ZeRO stage."""
        return int(self.engine.zero_optimization_stage())


def engine_state(components: Components) -> EngineState:
    """The :class:`EngineState` that the strategy's ``prepare`` stored in ``components``.

    Raises:
        RuntimeError: ``components`` were not prepared by the deepspeed strategy.
    """
    try:
        return components.extra[ENGINE_KEY]
    except KeyError:
        raise RuntimeError(
            "The deepspeed backend has not prepared these components (prepare was not run)."
        ) from None


def _zero_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if hasattr(p, "ds_id")]


def param_shape(param: torch.nn.Parameter) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


# ------------------------------------------------------------------ gather
def full_model_state(state: EngineState, ctx: WorkerContext) -> dict[str, torch.Tensor] | None:
    """Collective: the module's full fp32 state dict on rank 0 (``None`` elsewhere)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = state.engine.module
    params = list(module.parameters())
    # Stage 3: every rank takes part in gathering the partitioned parameters.
    with deepspeed.zero.GatheredParameters(_zero_params(params), modifier_rank=None):
        local = {
            key: value.detach().to("cpu", copy=True) if ctx.world_rank == 0 else None
            for key, value in module.state_dict().items()
        }
    low_precision = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    if low_precision and state.stage > 0:
        # fp16/bf16 module weights: read the fp32 master copies instead (collective).
        for name, param in module.named_parameters(remove_duplicate=False):
            full = safe_get_full_fp32_param(param)
            if full is not None and ctx.world_rank == 0:
                local[name] = full.detach().reshape(param_shape(param)).to("cpu", torch.float32)
    if ctx.world_rank != 0:
        return None
    return {
        key: value.float() if value is not None and value.is_floating_point() else value
        for key, value in local.items()
    }


def flat_partitions(ds_optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 flat partitions, the tensors ZeRO's inner optimizer keeps state for.

    Stage 3 empties the inner optimizer's param groups between steps, so they are
    read from the ZeRO optimizer itself.
    """
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        flats = getattr(ds_optimizer, name, None)
        if flats:
            return list(flats)
    return [p for group in ds_optimizer.optimizer.param_groups for p in group["params"]]


def flat_state_keys(ds_optimizer: Any) -> tuple[list[str], dict[str, Any]]:
    """Per-tensor state keys and scalar entries of ZeRO's inner optimizer (same on every rank)."""
    inner = ds_optimizer.optimizer
    for flat in flat_partitions(ds_optimizer):
        entry = inner.state.get(flat)
        if entry:
            tensors = sorted(
                k
                for k, v in entry.items()
                if torch.is_tensor(v) and v.shape == flat.shape and v.dim() > 0
            )
            scalars = {k: v for k, v in entry.items() if k not in tensors}
            return tensors, scalars
    return [], {}


def torch_param_groups(state: EngineState) -> list[dict[str, Any]]:
    groups, index = [], 0
    for group, params in zip(state.user_optimizer.param_groups, state.param_groups, strict=True):
        entry = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        entry["params"] = list(range(index, index + len(params)))
        index += len(params)
        groups.append(entry)
    return groups


def relink_optimizer_state(ds_optimizer: Any) -> None:
    """Point every parameter's ZeRO 1/2 fragment at the optimizer state as it is now.

    DeepSpeed links the fragments once, at the first step; param groups whose state
    did not exist yet then keep no fragment, and ``safe_get_full_optimizer_state``
    fails for them. Linking again is cheap (views only).
    """
    if hasattr(ds_optimizer, "_hp_optimizer_states_linked"):
        ds_optimizer._hp_optimizer_states_linked = False
        ds_optimizer._lazy_init_hp_params_optimizer_state()


def full_optimizer_state(state: EngineState) -> dict[str, Any] | None:
    """Collective: the optimizer state in torch format (``None``: no portable form)."""
    engine = state.engine
    if state.stage == 0:
        if engine.optimizer is state.user_optimizer:
            return state.user_optimizer.state_dict()
        logger.warning(
            "DeepSpeed stage 0 wraps the optimizer for mixed precision; its state has no "
            "portable torch form and is not saved (it starts fresh after loading)."
        )
        return None
    from deepspeed.utils import safe_get_full_optimizer_state

    relink_optimizer_state(engine.optimizer)
    tensor_keys, scalars = flat_state_keys(engine.optimizer)
    per_param: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(state.params):
        entry: dict[str, Any] = {}
        for key in tensor_keys:  # collective: every rank, same order
            full = safe_get_full_optimizer_state(param, key)
            if full is not None:
                entry[key] = full.detach().reshape(param_shape(param)).to("cpu", copy=True)
        if entry:
            entry.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
            per_param[index] = entry
    return {"state": per_param, "param_groups": torch_param_groups(state)}


# -------------------------------------------------------------------- load
def load_model_state(state: EngineState, model_state: dict[str, torch.Tensor]) -> None:
    """Collective: load full weights into the module and ZeRO's fp32 master partitions."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = state.engine.module
    params = list(module.parameters())
    # Stage 3: rank 0's loaded values are broadcast and re-partitioned on exit; every
    # rank loads the same checkpoint, so non-partitioned buffers match as well.
    with deepspeed.zero.GatheredParameters(_zero_params(params), modifier_rank=0):
        module.load_state_dict(model_state)
    if state.stage == 0:
        return
    # ZeRO keeps fp32 master partitions beside the module weights: update them too.
    named = dict(module.named_parameters(remove_duplicate=False))
    for name, param in named.items():
        if name in model_state:
            value = model_state[name].to(torch.float32)
            safe_set_full_fp32_param(param, value.to(_master_device(param, value)))


def _master_device(param: torch.nn.Parameter, value: torch.Tensor) -> torch.device:
    return param.device if param.device.type != "meta" else value.device


def load_optimizer_state(state: EngineState, saved: dict[str, Any] | None) -> None:
    """Collective: load a torch-format optimizer state into the (ZeRO) optimizer.

    Raises:
        CheckpointError: the checkpoint's param groups differ in number or size.
    """
    if saved is None:
        logger.warning(
            "The checkpoint has no optimizer state; the DeepSpeed optimizer starts fresh."
        )
        return
    if state.stage == 0 and state.engine.optimizer is state.user_optimizer:
        state.user_optimizer.load_state_dict(saved)
        return
    if state.stage == 0:
        logger.warning(
            "DeepSpeed stage 0 with mixed precision cannot take a torch optimizer state; "
            "the optimizer starts fresh."
        )
        return
    saved_groups = saved.get("param_groups") or []
    check_param_groups(state, saved_groups)
    # Hyperparameters (lr, betas, ...) come from the checkpoint, as in torch's load_state_dict.
    for group, saved_group in zip(state.user_optimizer.param_groups, saved_groups, strict=True):
        group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"})
    per_param = {int(k): v for k, v in (saved.get("state") or {}).items()}
    if per_param:
        _load_per_param_state(state, per_param)


def check_param_groups(state: EngineState, saved_groups: list[dict[str, Any]]) -> None:
    if len(saved_groups) != len(state.param_groups) or any(
        len(g["params"]) != len(p) for g, p in zip(saved_groups, state.param_groups, strict=False)
    ):
        raise CheckpointError(
            f"The checkpoint's optimizer has param groups of sizes "
            f"{[len(g['params']) for g in saved_groups]}; this optimizer has "
            f"{[len(p) for p in state.param_groups]}. Build the same optimizer as when saving."
        )


def _load_per_param_state(state: EngineState, per_param: dict[int, dict[str, Any]]) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    sample = next(iter(per_param.values()))
    tensor_keys = sorted(k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0)
    scalars = {k: v for k, v in sample.items() if k not in tensor_keys}
    inner = state.engine.optimizer.optimizer
    # A fresh ZeRO optimizer has no state yet: create it on the flat partitions, then
    # fill in each parameter's slice.
    for flat in flat_partitions(state.engine.optimizer):
        entry = inner.state[flat]
        for key in tensor_keys:
            if key not in entry:
                entry[key] = torch.zeros_like(flat)
        for key, value in scalars.items():
            entry[key] = value.clone() if torch.is_tensor(value) else value
    link = getattr(state.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    for index, param in enumerate(state.params):
        entry = per_param.get(index)
        if not entry:
            continue
        for key in tensor_keys:
            value = entry[key].to(torch.float32).reshape(-1)
            safe_set_full_optimizer_state(param, value, key)
