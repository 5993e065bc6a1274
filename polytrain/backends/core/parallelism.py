"""The ``parallelism=`` option and its mesh arithmetic (no framework imported).

``parallelism={"dp_replicate": R, "dp_shard": S, "tp": T}`` (Accelerate's names)
lays the workers out as a 3-D mesh ``(dp_replicate, dp_shard, tp)``:

* ``tp``: tensor parallelism, each block's matrices split over T workers;
* ``dp_shard``: data parallel with parameters, gradients and optimizer state sharded
  (FSDP, ZeRO-3) over S workers;
* ``dp_replicate``: data parallel with whole replicas of those shards on R groups
  (HSDP: only the gradient reduction crosses them).

``R * S * T`` must equal the number of workers; one of them may be ``-1``, "the
rest". The defaults ``dp_replicate=1, dp_shard=-1, tp=1`` are plain sharding over
every worker.

The mesh is laid out by node, as torchtitan lays it out: ranks ordered node by
node (their node rank, then their local rank), then filled in row-major order
with ``tp`` innermost. So with every node's worker count a multiple of T a TP
group never leaves a node (its all-reduces are on the fast links), the S ranks
of a shard group are neighbours too, and the replicas are the outermost
dimension: with ``S * T`` workers per node, HSDP replicates across nodes and
shards within them. :func:`mesh_ranks` computes it; the backends build their
``DeviceMesh`` from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

#: The mesh dimensions, outermost first.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
#: What the backends that train data parallel only tell a user who asks for more.
MESH_BACKENDS = (
    "backend='fsdp' (HSDP, tensor parallelism and both with FSDP) or backend='deepspeed' "
    "(tp as AutoTP, dp_replicate as ZeRO++ hpZ, where DeepSpeed supports them)"
)


@dataclass(frozen=True)
class Parallelism:
    """The sizes of the mesh dimensions (``-1``: the rest of the workers).

    Attributes:
        dp_replicate: replicas of the sharded model (HSDP's replication groups).
        dp_shard: workers each replica's parameters are sharded over.
        tp: tensor-parallel workers per model replica shard.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigTypeError(
                    f"parallelism[{name!r}] must be an int (a size >= 1, or -1 for the rest of "
                    f"the workers); got {type(value).__name__}: {value!r}."
                )
            if value < 1 and value != -1:
                raise ConfigError(
                    f"parallelism[{name!r}]={value} is not allowed: a size must be >= 1, or -1 "
                    f"for the rest of the workers."
                )
        rest = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ConfigError(
                f"parallelism sets {' and '.join(rest)} to -1; at most one size may be 'the "
                f"rest'. Give the others a number."
            )

    @classmethod
    def from_value(cls, value: Any) -> Parallelism | None:
        """``value`` (None, a :class:`Parallelism` or a mapping of :data:`MESH_DIMS`) as a config.

        Raises:
            ConfigTypeError: an unknown key or a value of the wrong type.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigTypeError(
                f"parallelism must be a dict of {', '.join(MESH_DIMS)} (e.g. "
                f'{{"dp_shard": 2, "tp": 2}}) or None; got {type(value).__name__}: {value!r}.'
            )
        unknown = sorted(set(value) - set(MESH_DIMS))
        if unknown:
            raise ConfigTypeError(
                f"Unknown parallelism key(s) {unknown}. Allowed keys: {list(MESH_DIMS)} "
                f"(-1: the rest of the workers)."
            )
        sizes = dict(value)
        if -1 in sizes.values():  # another size is "the rest": dp_shard defaults to 1 then
            sizes.setdefault("dp_shard", 1)
        return cls(**sizes)

    def resolve(self, num_workers: int) -> Parallelism:
        """The sizes for ``num_workers`` workers, ``-1`` filled in.

        Raises:
            ConfigError: the product does not equal ``num_workers`` (or does not divide it,
                with a ``-1``), naming the sizes, the workers and what to change.
        """
        workers = max(int(num_workers), 1)
        fixed = math.prod(getattr(self, name) for name in MESH_DIMS if getattr(self, name) != -1)
        rest = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if rest:
            if workers % fixed:
                raise ConfigError(
                    f"parallelism={self.as_dict()} needs a multiple of {fixed} workers (the "
                    f"product of the given sizes, with {rest[0]} the rest); num_workers="
                    f"{num_workers}. Change num_workers or the sizes."
                )
            return Parallelism(**{**self.as_dict(), rest[0]: workers // fixed})
        if fixed != workers:
            raise ConfigError(
                f"parallelism={self.as_dict()}: dp_replicate * dp_shard * tp = {fixed}, but "
                f"num_workers={num_workers}. The product must equal the workers; set one size "
                f"to -1 for the rest of them."
            )
        return self

    def as_dict(self) -> dict[str, int]:
        """The sizes by name."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, tp)``."""
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def data_parallel_size(self) -> int:
        """Workers that see different data: ``dp_replicate * dp_shard`` (resolved sizes)."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_data_parallel(self) -> bool:
        """True for plain sharding over every worker (no replication groups, no TP)."""
        return self.dp_replicate == 1 and self.tp == 1

    def __str__(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in MESH_DIMS)


def node_order(places: Sequence[tuple[int, int]]) -> list[int]:
    """World ranks ordered node by node: by ``(node_rank, local_rank)`` (ties: by rank)."""
    return sorted(range(len(places)), key=lambda rank: (*places[rank], rank))


def mesh_ranks(parallelism: Parallelism, places: Sequence[tuple[int, int]]) -> list:
    """The world ranks as a nested ``[dp_replicate][dp_shard][tp]`` list, laid out by node.

    Args:
        parallelism: resolved sizes whose product is ``len(places)``.
        places: ``(node_rank, local_rank)`` of every world rank, in rank order.

    Raises:
        ConfigError: a node whose worker count is not a multiple of ``tp`` (a TP group
            would span nodes), naming the node and its workers.
    """
    R, S, T = parallelism.shape
    if R * S * T != len(places):
        raise ConfigError(f"parallelism {parallelism} does not cover the {len(places)} workers.")
    per_node: dict[int, int] = {}
    for node, _ in places:
        per_node[node] = per_node.get(node, 0) + 1
    for node, count in sorted(per_node.items()):
        if count % T:
            raise ConfigError(
                f"parallelism tp={T} must fit inside a node (tensor parallelism all-reduces "
                f"every layer), but node {node} has {count} worker(s): each node's workers must "
                f"be a multiple of tp. Lower tp, or place the workers so that every node holds "
                f"a multiple of {T} (e.g. scaling placement_strategy='STRICT_PACK')."
            )
    order = node_order(places)
    return [[order[(r * S + s) * T : (r * S + s + 1) * T] for s in range(S)] for r in range(R)]


def coordinates(layout: Sequence, rank: int) -> tuple[int, int, int]:
    """``(replica, shard, tp)`` index of ``rank`` in a :func:`mesh_ranks` layout."""
    for r, plane in enumerate(layout):
        for s, row in enumerate(plane):
            if rank in row:
                return (r, s, list(row).index(rank))
    raise ConfigError(f"rank {rank} is not in the mesh {layout}.")


def groups(layout: Sequence, dim: str) -> list[list[int]]:
    """The rank groups along mesh dimension ``dim`` (each group varies only that index)."""
    R, S, T = len(layout), len(layout[0]), len(layout[0][0])
    index = MESH_DIMS.index(dim)
    others = [(a, b) for a in range((S, R, R)[index]) for b in range((T, T, S)[index])]
    result = []
    for a, b in others:
        if index == 0:
            result.append([layout[r][a][b] for r in range(R)])
        elif index == 1:
            result.append([layout[a][s][b] for s in range(S)])
        else:
            result.append([layout[a][b][t] for t in range(T)])
    return result


def data_parallel_rank(parallelism: Parallelism, coords: tuple[int, int, int]) -> int:
    """The rank among the ``dp_replicate * dp_shard`` data-parallel ranks (TP peers share it)."""
    return coords[0] * parallelism.dp_shard + coords[1]


def mesh_request(
    parallelism: Any, tp_plan: Any, num_workers: int, min_workers: int | None = None
) -> Parallelism | None:
    """Driver: the resolved sizes a trainer asks a backend for (None: plain data parallel).

    Raises:
        ConfigError: sizes that do not match ``num_workers``, ``tp_plan`` without
            ``tp > 1``, or a mesh with elastic ``min_workers`` (its sizes are fixed).
    """
    config = Parallelism.from_value(parallelism)
    sizes = config.resolve(num_workers) if config is not None else None
    if tp_plan is not None and (sizes is None or sizes.tp == 1):
        raise ConfigError(
            f"tp_plan= splits layers over tensor-parallel ranks, but parallelism="
            f"{sizes.as_dict() if sizes else None} has tp=1. Set parallelism={{'tp': N, ...}} "
            f"or drop tp_plan."
        )
    if sizes is None or (sizes.is_data_parallel and tp_plan is None):
        return None
    if min_workers is not None and min_workers != num_workers:
        raise ConfigError(
            f"parallelism={sizes.as_dict()} lays the workers out as a fixed mesh, which "
            f"cannot shrink: drop scaling min_workers={min_workers}, or use plain data "
            f"parallelism (no tp, no dp_replicate) for elastic training."
        )
    return sizes


def refuse_mesh(backend: str, sizes: Parallelism, reason: str) -> ConfigError:
    """The error for a layout ``backend`` cannot run, naming the backends that can."""
    return ConfigError(
        f"parallelism={sizes.as_dict()} is not supported by the {backend} backend: {reason}. "
        f"Use {MESH_BACKENDS}, or plain data parallelism (dp_shard or dp_replicate alone)."
    )


def adapter_modules(model: Any) -> list[str]:
    """The names of ``model``'s PEFT modules (a ``PeftModel``, LoRA layers), without importing peft."""
    named = getattr(model, "named_modules", None)
    if named is None:
        return []
    return [name or "<root>" for name, module in named() if _is_peft(module)]


def _is_peft(module: Any) -> bool:
    return type(module).__module__.split(".", 1)[0] == "peft"


def refuse_adapters_under_tp(model: Any, tp: int) -> None:
    """Raises ConfigError when ``tp > 1`` and ``model`` carries PEFT adapters (LoRA).

    A TP plan splits the model's own linear layers; PEFT replaces them with adapter
    layers that wrap the original (``base_layer``) and add ``lora_A`` / ``lora_B``,
    which no plan splits. Rather than shard the base and leave the adapters' shapes
    wrong, the combination is refused with what to use instead.
    """
    if tp <= 1:
        return
    found = adapter_modules(model)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise _adapters_under_tp(tp, f"a model with PEFT adapters ({shown})")


def refuse_tp_with_peft_config(tp: int) -> None:
    """Driver: raises ConfigError for a trainer's ``peft_config=`` with ``tp > 1``."""
    if tp > 1:
        raise _adapters_under_tp(tp, "the adapters of peft_config=")


def _adapters_under_tp(tp: int, what: str) -> ConfigError:
    return ConfigError(
        f"parallelism tp={tp} cannot split {what}: PEFT's adapter layers wrap the linear "
        f"layers a tensor-parallel plan splits, and no plan splits the adapters. Fine-tune "
        f"adapters with data parallelism, which shards the frozen base too "
        f"(parallelism={{'dp_shard': -1}} on fsdp or deepspeed, dp_replicate x dp_shard for "
        f"HSDP), or set tp=1."
    )
