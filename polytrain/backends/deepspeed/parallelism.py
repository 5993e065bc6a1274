"""``parallelism=`` on the deepspeed backend: ``tp`` as AutoTP, ``dp_replicate`` as ZeRO++ hpZ (driver side).

DeepSpeed's own versions of the mesh layouts:

* ``{"dp_replicate": R, "dp_shard": S}`` is ZeRO-3 with ZeRO++'s hierarchical
  partitioning (``zero_hpz_partition_size = S``): besides ZeRO-3's partition of the
  parameters over all ``R * S`` ranks, each group of S consecutive ranks (a node,
  with S workers per node) keeps a secondary partition of them, so the all-gathers
  of the backward pass stay inside the group. Unlike FSDP's HSDP, the optimizer
  state and the gradients stay partitioned over all ranks (less memory per rank,
  a reduce-scatter over all of them). Measured on CPU with gloo: ZeRO-3 + hpZ 2 on
  4 ranks trains a tiny Llama equal to one process.
* ``{"tp": T}`` with ``dp_shard`` or ``dp_replicate`` (one of them) is AutoTP
  (``tensor_parallel.autotp_size = T``, TP over groups of T consecutive ranks) with
  ZeRO at the configured stage over the data-parallel groups
  (:mod:`polytrain.backends.deepspeed.strategy_tp`). Measured on CPU with gloo: TP 2
  x ZeRO-1 over 2 trains a tiny Llama equal to one process, clip included.
* hpZ and AutoTP together (all three sizes > 1) are refused.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from polytrain.backends.core.parallelism import Parallelism, refuse_mesh
from polytrain.errors import ConfigError

if TYPE_CHECKING:
    from polytrain.backends.deepspeed.config import DeepSpeedConfig


def check_mesh(sizes: Parallelism, tp_plan: Any, stage: int) -> None:
    """Driver: refuse what DeepSpeed cannot run, with the reason.

    Raises:
        ConfigError: ``tp_plan`` (fsdp's), hpZ with AutoTP, or hpZ without stage 3.
    """
    if tp_plan is not None:
        raise ConfigError(
            "tp_plan= is the fsdp backend's (torch's parallelize_module); DeepSpeed's AutoTP "
            "finds the layers itself. Use backend='fsdp' for a plan of your own."
        )
    if sizes.tp > 1 and sizes.dp_replicate > 1 and sizes.dp_shard > 1:
        raise refuse_mesh(
            "deepspeed",
            sizes,
            "ZeRO++ hpZ (dp_replicate x dp_shard) and AutoTP (tp) together "
            "are not supported here; drop dp_replicate or tp, or use backend='fsdp'",
        )
    if sizes.dp_replicate > 1 and sizes.dp_shard > 1 and stage != 3:
        raise ConfigError(
            f"parallelism={sizes.as_dict()} on the deepspeed backend is ZeRO++ hierarchical "
            f"partitioning (hpZ), which partitions parameters: it needs ZeRO stage 3, but the "
            f"config has stage {stage}. Set backend_config={{'stage': 3}}, or use "
            f"backend='fsdp' for HSDP."
        )


def mesh_sections(sizes: Parallelism) -> dict[str, Any]:
    """The DeepSpeed config sections that carry ``sizes`` (merged over the user's config)."""
    sections: dict[str, Any] = {}
    if sizes.dp_replicate > 1 and sizes.dp_shard > 1:
        sections["zero_optimization"] = {"zero_hpz_partition_size": sizes.dp_shard}
    if sizes.tp > 1:
        sections["tensor_parallel"] = {"autotp_size": sizes.tp}
    return sections


def with_mesh(config: DeepSpeedConfig, sizes: Parallelism) -> DeepSpeedConfig:
    """``config`` with the sections of ``sizes`` merged into its DeepSpeed config.

    Raises:
        ConfigError: the DeepSpeed config already sets one of them to another value.
    """
    merged = copy.deepcopy(config.resolved())
    for name, section in mesh_sections(sizes).items():
        target = merged.setdefault(name, {})
        for key, value in section.items():
            if target.get(key, value) != value:
                raise ConfigError(
                    f"parallelism={sizes.as_dict()} means {name}.{key}={value!r}, but the "
                    f"DeepSpeed config sets {target[key]!r}. Set it in one place only."
                )
            target[key] = value
    return dataclasses.replace(config, config=merged)
