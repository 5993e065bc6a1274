"""The ``fsdp`` backend as Accelerate's FSDP plugin: the ``FSDP_*`` environment of ``accelerate launch``.

Accelerate's ``FullyShardedDataParallelPlugin`` reads these variables when an
``Accelerator()`` (or the HF ``Trainer``, which builds one) is created without a
plugin of its own. Each :class:`~polytrain.backends.fsdp.config.FSDPConfig` field
maps to one of them:

====================  ===================================================
FSDPConfig            Accelerate (variable: value)
====================  ===================================================
version               FSDP_VERSION: 1 or 2
sharding_strategy     FSDP_SHARDING_STRATEGY (version 1), FSDP_RESHARD_AFTER_FORWARD
                      (version 2: FULL_SHARD true, SHARD_GRAD_OP false)
auto_wrap_policy      FSDP_AUTO_WRAP_POLICY: "auto" / "transformer" TRANSFORMER_BASED_WRAP
                      (the model's ``_no_split_modules``), a list TRANSFORMER_BASED_WRAP with
                      FSDP_TRANSFORMER_CLS_TO_WRAP, "size_based" SIZE_BASED_WRAP with
                      FSDP_MIN_NUM_PARAMS, "none" NO_WRAP
sync_module_states    FSDP_SYNC_MODULE_STATES (version 1; version 2 has no such setting)
init_on_rank0         FSDP_CPU_RAM_EFFICIENT_LOADING (rank 0 loads, the others get its
                      weights as shards)
forward_prefetch      FSDP_FORWARD_PREFETCH (version 1)
====================  ===================================================

``limit_all_gathers=False`` (FSDP1) has no Accelerate variable, and neither has
FSDP2 with ``sync_module_states=True, init_on_rank0=False`` (Accelerate's FSDP2
broadcasts rank 0's weights only with ``cpu_ram_efficient_loading``): both are
refused.
"""

from __future__ import annotations

from polytrain.backends.fsdp.config import FSDPConfig
from polytrain.errors import ConfigError

#: Why Accelerate cannot shard on CPU workers (its CPU mode is plain DDP over gloo).
CPU_REFUSAL = (
    "Accelerate shards with FSDP only on accelerators: with use_cpu it runs its MULTI_CPU "
    "mode (DDP over gloo) and drops the FSDP plugin, and without it a CPU worker trains as "
    "one process of its own. Use use_gpu=True, or backend='ddp' on CPU (polytrain's own "
    "fsdp loop helpers, polytrain.train.torch.prepare, shard on CPU too)."
)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def fsdp_accelerate_env(config: FSDPConfig, use_gpu: bool) -> dict[str, str]:
    """The ``FSDP_*`` variables that make Accelerate shard as ``config`` says.

    Raises:
        ConfigError: on CPU workers, or ``limit_all_gathers=False``.
    """
    if not use_gpu:
        raise ConfigError(f"The fsdp backend cannot run under Accelerate here: {CPU_REFUSAL}")
    if not config.limit_all_gathers:
        raise ConfigError(
            "backend_config limit_all_gathers=False has no Accelerate setting (Accelerate's "
            "FSDP plugin always limits them). Drop it to train the HF Trainer or an "
            "Accelerator() on the fsdp backend."
        )
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": str(config.version),
        "FSDP_CPU_RAM_EFFICIENT_LOADING": _flag(bool(config.init_on_rank0)),
    }
    if config.version == 1:
        env["FSDP_SYNC_MODULE_STATES"] = _flag(config.sync_module_states)
        env["FSDP_SHARDING_STRATEGY"] = config.sharding_strategy
        env["FSDP_FORWARD_PREFETCH"] = _flag(config.forward_prefetch)
    else:
        if config.sync_module_states and not config.init_on_rank0:
            raise ConfigError(
                "backend_config sync_module_states=True with init_on_rank0=False has no "
                "Accelerate setting for FSDP2: Accelerate broadcasts rank 0's weights only "
                "when rank 0 alone builds them (init_on_rank0, its cpu_ram_efficient_loading). "
                "Drop init_on_rank0=False, or set sync_module_states=False."
            )
        env["FSDP_RESHARD_AFTER_FORWARD"] = _flag(config.sharding_strategy == "FULL_SHARD")
    policy = config.auto_wrap_policy
    if policy in ("auto", "transformer"):
        env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"
    elif policy == "size_based":
        env["FSDP_AUTO_WRAP_POLICY"] = "SIZE_BASED_WRAP"
        env["FSDP_MIN_NUM_PARAMS"] = str(config.min_num_params)
    elif policy == "none":
        env["FSDP_AUTO_WRAP_POLICY"] = "NO_WRAP"
    else:  # block classes or their names
        names = [item if isinstance(item, str) else item.__name__ for item in policy]
        env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"
        env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(names)
    return env
