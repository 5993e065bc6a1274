"""Ray Data input: ``TorchTrainer(..., datasets={"train": ds, "val": ds})``.

The driver splits each ``ray.data.Dataset`` once per worker group with
``streaming_split(n, equal=True)`` (equal row counts per worker for training, all rows
once for validation; locality-aware,
streamed: no worker materialises the whole data set) and hands every worker its
own split before the creators run. On the worker, :func:`shard_loaders` stands in
for a ``data_creator``: each split is iterated with ``iter_torch_batches`` at
the per-worker batch (``config["batch_size"]`` is the global batch, as for
DataLoaders), and each batch becomes a tuple of its columns in the data set's
column order, so the default training step reads ``(features..., target)``:
put the label column last. A token data set (one with an ``input_ids`` column,
as tokenizers and ``polytrain.hf.data`` make) gives mapping batches instead,
``{column: tensor}``, which the default step passes as ``model(**batch)``: models
that read token ids (transformers') take their inputs by name.

A new split is made at every group start (and restart), so a restarted group
never waits on a coordinator of the old one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

__all__ = [
    "DATASET_KEYS",
    "ShardLoader",
    "check_datasets",
    "receive_shards",
    "shard_loaders",
    "split",
]

#: The keys ``datasets=`` accepts.
DATASET_KEYS = ("train", "val")

#: Where a worker keeps its splits between :func:`receive_shards` and :func:`shard_loaders`.
_SHARDS_KEY = "ray_data_shards"


def _is_dataset(value: Any) -> bool:
    try:
        from ray.data import Dataset
    except ImportError:  # pragma: no cover - ray[data] is a dependency
        return False
    return isinstance(value, Dataset)


def check_datasets(
    datasets: Any, data_creator: Any, alternative: str = "DataLoaders"
) -> dict[str, Any] | None:
    """Validate ``datasets=`` on the driver; return it as a dict (None when not given).

    ``alternative`` names what a ``data_creator`` returns instead, for the error message.

    Raises:
        ConfigTypeError: not a dict of ``ray.data.Dataset``.
        ConfigError: an unknown key, no ``"train"``, or a ``data_creator`` given too.
    """
    if datasets is None:
        return None
    if not isinstance(datasets, Mapping):
        raise ConfigTypeError(
            f"datasets must be a dict like {{'train': ray_dataset, 'val': ray_dataset}}; got "
            f"{type(datasets).__name__}."
        )
    unknown = sorted(set(datasets) - set(DATASET_KEYS))
    if unknown or "train" not in datasets:
        raise ConfigError(
            f"datasets takes the keys {DATASET_KEYS} ('train' required); got {sorted(datasets)}."
        )
    for key, value in datasets.items():
        if not _is_dataset(value):
            raise ConfigTypeError(
                f"datasets[{key!r}] must be a ray.data.Dataset (ray.data.from_numpy, "
                f"read_parquet, ...); got {type(value).__name__}. Give {alternative} through "
                f"data_creator instead."
            )
    if data_creator is not None:
        raise ConfigError(
            "Both data_creator and datasets were given; the training data comes from one of "
            "them. Drop data_creator to train from the Ray Datasets."
        )
    return dict(datasets)


def split(datasets: Mapping[str, Any], num_workers: int) -> list[dict[str, Any]]:
    """Driver: one ``{"train": (iterator, columns), "val": ...}`` per worker, in rank order."""
    from polytrain.compat import quiet

    shards: list[dict[str, Any]] = [{} for _ in range(num_workers)]
    for key, dataset in datasets.items():
        if not quiet.is_verbose():
            # Ray Data's progress bars and start lines would print from its coordinator
            # actor on every epoch of every worker.
            dataset.context.enable_progress_bars = False
            dataset.context.print_on_execution_start = False
        columns = tuple(dataset.schema().names)
        # Training splits are equal (every worker takes the same steps: collectives stay
        # in step); validation splits are not, so every validation row counts once.
        splits = dataset.streaming_split(num_workers, equal=key == "train")
        for rank, iterator in enumerate(splits):
            shards[rank][key] = (iterator, columns)
    return shards


def receive_shards(shards: dict[str, Any]) -> None:
    """Worker: keep this worker's splits for :func:`shard_loaders` (called before the creators)."""
    from polytrain.launchers.worker import WORKER_STATE

    WORKER_STATE[_SHARDS_KEY] = shards


#: The column that makes a data set's batches mappings (token data).
TOKEN_COLUMN = "input_ids"


class ShardLoader:
    """A worker's split of a Ray Dataset as an iterable of torch batches (one pass per epoch).

    Args:
        iterator: the ``DataIterator`` of this worker's split.
        columns: the data set's column names: each batch is a tuple in this order
            (a mapping of them when ``input_ids`` is among them).
        batch_size: rows per batch on this worker.
        training: drop a last, smaller batch (every worker then takes the same steps).
    """

    def __init__(self, iterator: Any, columns: tuple[str, ...], batch_size: int, training: bool):
        self.iterator = iterator
        self.columns = columns
        self.batch_size = batch_size
        self.training = training

    def __iter__(self) -> Iterator[tuple[Any, ...] | dict[str, Any]]:
        batches = self.iterator.iter_torch_batches(
            batch_size=self.batch_size, drop_last=self.training
        )
        as_mapping = TOKEN_COLUMN in self.columns
        for batch in batches:
            if as_mapping:
                yield {column: batch[column] for column in self.columns}
            else:
                yield tuple(batch[column] for column in self.columns)

    def __repr__(self) -> str:
        return f"ShardLoader(columns={self.columns}, batch_size={self.batch_size})"


def shard_loaders(config: dict[str, Any]) -> tuple[ShardLoader, ShardLoader | None]:
    """Worker: the ``data_creator`` of a trainer given ``datasets=``: this worker's loaders.

    Raises:
        ConfigError: no ``batch_size`` in the config (it sets the rows per batch).
    """
    from polytrain.launchers.worker import WORKER_STATE

    if "batch_size" not in config:
        raise ConfigError(
            "Training from datasets= needs config['batch_size'] (the global batch); add it."
        )
    shards = WORKER_STATE[_SHARDS_KEY]
    batch = int(config["batch_size"])
    train = ShardLoader(*shards["train"], batch_size=batch, training=True)
    val = ShardLoader(*shards["val"], batch_size=batch, training=False) if "val" in shards else None
    return train, val
