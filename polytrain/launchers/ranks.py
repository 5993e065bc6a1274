"""Rank, address and environment bookkeeping as pure functions (no Ray, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class WorkerMetadata:
    """Where a worker process runs, as it reports itself."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankInfo:
    """A worker's place in the group."""

    world_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int


def order_by_node(node_ids: Sequence[str]) -> list[int]:
    """A permutation of worker indices that puts co-located workers next to each other.

    Nodes keep the order in which they first appear; workers keep their order within
    a node. Contiguous ranks per node is what torchrun and Horovod assume for local
    ranks and hierarchical collectives.
    """
    first_seen: dict[str, int] = {}
    for node in node_ids:
        first_seen.setdefault(node, len(first_seen))
    return sorted(range(len(node_ids)), key=lambda i: (first_seen[node_ids[i]], i))


def compute_ranks(node_ids: Sequence[str]) -> list[RankInfo]:
    """Rank information for workers in the given order (world rank = position)."""
    world_size = len(node_ids)
    node_rank_of: dict[str, int] = {}
    per_node: dict[str, int] = {}
    for node in node_ids:
        node_rank_of.setdefault(node, len(node_rank_of))
        per_node[node] = per_node.get(node, 0) + 1
    seen: dict[str, int] = {}
    infos = []
    for rank, node in enumerate(node_ids):
        local_rank = seen.get(node, 0)
        seen[node] = local_rank + 1
        infos.append(
            RankInfo(
                world_rank=rank,
                local_rank=local_rank,
                world_size=world_size,
                local_world_size=per_node[node],
                node_rank=node_rank_of[node],
            )
        )
    return infos


def shared_visible_devices(metadata: Sequence[WorkerMetadata]) -> list[tuple[str, int]]:
    """Per worker: the ``CUDA_VISIBLE_DEVICES`` value shared by its node, and its device index.

    Ray gives every GPU actor only its own GPU. NCCL's intra-node paths (P2P, NVLink)
    need every co-located worker to see all the node's GPUs, so each worker gets the
    union of its node's GPU ids and uses the index of its own GPU in that list.
    """
    per_node: dict[str, set[str]] = {}
    for meta in metadata:
        per_node.setdefault(meta.node_id, set()).update(meta.gpu_ids)
    result = []
    for meta in metadata:
        devices = sorted(per_node[meta.node_id], key=lambda g: (len(g), g))
        own = meta.gpu_ids[0] if meta.gpu_ids else None
        result.append((",".join(devices), devices.index(own) if own is not None else -1))
    return result


def torch_distributed_env(info: RankInfo, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment ``torchrun`` would give this worker."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(info.world_rank),
        "LOCAL_RANK": str(info.local_rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "GROUP_RANK": str(info.node_rank),
        "NODE_RANK": str(info.node_rank),
    }


def split_batch_size(global_batch_size: int, num_workers: int) -> int:
    """The per-worker batch for a global batch: ``global // num_workers`` (at least one worker).

    Raises:
        ConfigError: ``global_batch_size`` < ``num_workers`` (some worker would get 0).
    """
    workers = max(num_workers, 1)
    if global_batch_size < workers:
        raise ConfigError(
            f"config['batch_size']={global_batch_size} is the global batch and must be at least "
            f"num_workers={num_workers} (each worker gets batch_size // num_workers samples). "
            f"Raise batch_size or lower num_workers."
        )
    return global_batch_size // workers
