"""Options of the ``fsdp`` backend, both versions (what ``backend_config=`` accepts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polytrain.backends.core.backend import BackendConfig
from polytrain.errors import ConfigError, ConfigTypeError

#: The named wrap policies; a list of classes or class names is the other form.
AUTO_WRAP_POLICIES = ("auto", "transformer", "size_based", "none")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
FSDP_VERSIONS = (1, 2)


@dataclass
class FSDPConfig(BackendConfig):
    """Options of the ``fsdp`` backend.

    Attributes:
        version: 2 (default: ``fully_shard``, FSDP2) or 1 (``FullyShardedDataParallel``,
            FSDP1, legacy).
        sharding_strategy: "FULL_SHARD" (parameters, gradients and optimizer state
            sharded; ZeRO-3, default), "SHARD_GRAD_OP" (parameters gathered from forward
            to backward; ZeRO-2) or "NO_SHARD" (replicated, like DDP; version 1 only).
            Version 2 maps them to ``reshard_after_forward`` True and False.
        auto_wrap_policy: which submodules become FSDP units, so only one unit's
            parameters are gathered at a time: "auto" (default: the repeated blocks of a
            transformer, else "size_based"), "transformer", a list of block classes or
            class names, "size_based" or "none" (see :mod:`polytrain.backends.fsdp.wrap`).
        min_num_params: the size threshold of the "size_based" policy.
        sync_module_states: broadcast rank 0's parameters and buffers when wrapping.
        init_on_rank0: only rank 0 builds the full model (``model_creator`` runs for real
            there); the other ranks build it on the meta device and receive their shards
            of rank 0's weights after sharding, so no other rank ever holds the full
            weights. None (default): on, unless ``sync_module_states=False`` (each rank
            keeps its own weights, so each must build them). False: every rank builds the
            full model (for a creator that cannot run on the meta device).
        forward_prefetch: FSDP1's flag: gather the next unit's parameters during forward
            (True: version 1 only; FSDP2 overlaps its all-gathers by itself).
        limit_all_gathers: FSDP1's flag: bound the memory of in-flight all-gathers
            (False: version 1 only; FSDP2 always bounds it).
    """

    version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: Any = "auto"
    min_num_params: int = 100_000
    sync_module_states: bool = True
    init_on_rank0: bool | None = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    def __post_init__(self) -> None:
        strategy = str(self.sharding_strategy).upper()
        if strategy not in SHARDING_STRATEGIES:
            raise ConfigError(
                f"The provided sharding_strategy ({self.sharding_strategy!r}) is not supported. "
                f"Must be one of {', '.join(repr(s) for s in SHARDING_STRATEGIES)}."
            )
        self.sharding_strategy = strategy
        self.auto_wrap_policy = check_auto_wrap_policy(self.auto_wrap_policy)
        if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int):
            raise ConfigTypeError(
                f"min_num_params must be a positive int; got {self.min_num_params!r}."
            )
        if self.min_num_params < 1:
            raise ConfigError(f"min_num_params must be a positive int; got {self.min_num_params}.")
        self._check_version()
        self.init_on_rank0 = resolve_init_on_rank0(self.init_on_rank0, self.sync_module_states)

    def _check_version(self) -> None:
        if type(self.version) is not int or self.version not in FSDP_VERSIONS:
            raise ConfigError(
                f"The provided version ({self.version!r}) is not supported. Must be 2 "
                f"(fully_shard, FSDP2; the default) or 1 (FullyShardedDataParallel, FSDP1)."
            )
        if self.version == 1:
            return
        v1_only = {
            "sharding_strategy": ("NO_SHARD", self.sharding_strategy == "NO_SHARD"),
            "forward_prefetch": (True, self.forward_prefetch),
            "limit_all_gathers": (False, not self.limit_all_gathers),
        }
        for name, (value, given) in v1_only.items():
            if given:
                raise ConfigError(
                    f"{name}={value!r} is an FSDP1 option: version 2 (fully_shard) has no such "
                    f"setting. Add 'version': 1 to backend_config to use it, or drop it."
                )


def resolve_init_on_rank0(value: Any, sync_module_states: bool) -> bool:
    """Driver: ``init_on_rank0`` as a bool (None: on exactly when rank 0's weights are synced).

    Raises:
        ConfigTypeError: not a bool or None.
        ConfigError: True with ``sync_module_states=False`` (rank 0's weights would be synced).
    """
    if value is not None and not isinstance(value, bool):
        raise ConfigTypeError(
            f"init_on_rank0 must be True, False or None (the default: on unless "
            f"sync_module_states=False); got {value!r}."
        )
    if value and not sync_module_states:
        raise ConfigError(
            "init_on_rank0=True gives every rank rank 0's weights, which contradicts "
            "sync_module_states=False (each rank keeps its own). Drop one of the two."
        )
    return bool(sync_module_states) if value is None else value


def check_auto_wrap_policy(value: Any) -> str | tuple[Any, ...]:
    """Driver: ``value`` as a policy name or a tuple of classes / class names.

    Raises:
        ConfigError: an unknown name, or a list with something else than classes and names.
    """
    if isinstance(value, str):
        if value not in AUTO_WRAP_POLICIES:
            raise ConfigError(
                f"The provided auto_wrap_policy ({value!r}) is not supported. Must be one of "
                f"{', '.join(repr(p) for p in AUTO_WRAP_POLICIES)}, or a list of module classes "
                f"or class names to wrap (e.g. ['GPT2Block'])."
            )
        return value
    items = tuple(value) if isinstance(value, (list, tuple, set)) else (value,)
    bad = [item for item in items if not (isinstance(item, str) or _is_module_class(item))]
    if not items or bad:
        raise ConfigError(
            f"auto_wrap_policy={value!r} is not supported: a list must hold nn.Module classes or "
            f"class names (e.g. ['GPT2Block'] or [GPT2Block]); got {bad or 'an empty list'}. Or "
            f"use one of {', '.join(repr(p) for p in AUTO_WRAP_POLICIES)}."
        )
    return items


def _is_module_class(item: Any) -> bool:
    return isinstance(item, type) and issubclass(item, torch.nn.Module)
