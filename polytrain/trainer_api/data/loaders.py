"""Give the user's DataLoaders a distributed sampler (worker side)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

logger = logging.getLogger(__name__)


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``n`` gets indices ``r, r + n, r + 2n, ...``, with no padding.

    For evaluation: ``DistributedSampler`` repeats samples so every rank gets the
    same count, which skews a validation mean. Here every sample is seen exactly
    once, and the sample-weighted mean over ranks equals the single-process mean.
    """

    def __init__(self, dataset: Any, num_replicas: int, rank: int) -> None:
        self.dataset_len = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_len, self.num_replicas))

    def __len__(self) -> int:
        return max(0, math.ceil((self.dataset_len - self.rank) / self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Evaluation order does not change between epochs."""


def _rebuild(loader: DataLoader, sampler: Sampler) -> DataLoader:
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
    )


def add_distributed_sampler(loader: Any, num_replicas: int, rank: int, training: bool) -> Any:
    """Return ``loader`` rebuilt with a sampler that gives this rank its share.

    Training loaders get a ``DistributedSampler`` (shuffled when the original loader
    shuffled; ``set_epoch`` reshuffles each epoch). Evaluation loaders get an
    :class:`UnpaddedDistributedSampler`. Loaders that already have a distributed
    sampler, custom batch samplers, iterable datasets and non-DataLoader iterables
    are returned unchanged.
    """
    if not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        logger.warning(
            "An IterableDataset cannot be given a distributed sampler; "
            "shard it yourself (rank %d of %d).",
            rank,
            num_replicas,
        )
        return loader
    if isinstance(loader.sampler, (DistributedSampler, UnpaddedDistributedSampler)):
        return loader
    if loader.batch_size is None:  # a custom batch_sampler: we cannot split it safely
        logger.warning(
            "A DataLoader with a custom batch_sampler is left as it is; make it "
            "rank-aware yourself or pass add_dist_sampler=False."
        )
        return loader
    if training:
        shuffle = isinstance(loader.sampler, RandomSampler)
        seed = 0
        if shuffle and loader.generator is not None:
            seed = int(loader.generator.initial_seed())
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
        )
    else:
        sampler = UnpaddedDistributedSampler(loader.dataset, num_replicas, rank)
    return _rebuild(loader, sampler)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Advance the loader's sampler to ``epoch`` (reshuffles a DistributedSampler)."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(item, device) for item in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch
