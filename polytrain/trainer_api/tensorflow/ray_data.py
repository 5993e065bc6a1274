"""Ray Data input for TensorFlow: ``TFTrainer(..., datasets={"train": ds, "val": ds})``.

The driver validates and splits the data sets as for ``TorchTrainer``
(:mod:`polytrain.trainer_api.data.ray_data`: ``streaming_split`` with equal training
splits, validation rows once). On every worker, :func:`shard_datasets` stands in for
the ``data_creator``: each split becomes a ``tf.data.Dataset`` through Ray's
``DataIterator.to_tf`` (a generator that re-iterates the split at every epoch, with
auto-sharding off: the worker already holds only its own rows).

Columns: by default the last column is the label and every other column a feature,
the convention of the torch path. ``dataset_columns={"features": ..., "label": ...}``
picks them by name. A single name gives Keras a tensor; a list gives a dict keyed by
column name (a functional model with named ``keras.Input`` layers).

The global batch: each worker reads its split in batches of ``config["batch_size"]``
(the global batch, as in the ``data_creator`` path) and MultiWorkerMirroredStrategy
cuts every such batch into ``num_workers`` slices, one per step; so every step takes
``batch_size / num_workers`` rows from each worker's split, ``batch_size`` in all,
and an epoch is about ``rows / batch_size`` steps on every worker count. Training
drops each split's last, incomplete batch: with equal splits every worker then takes
the same number of steps, so no worker waits in a collective for one that ran out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from polytrain.errors import ConfigError, ConfigTypeError

__all__ = [
    "COLUMN_KEYS",
    "check_columns",
    "receive_shards",
    "resolve_columns",
    "shard_datasets",
    "turn_off_auto_shard",
]

#: The keys ``dataset_columns=`` accepts.
COLUMN_KEYS = ("features", "label")

#: Where a worker keeps its splits and columns until :func:`shard_datasets` runs.
_KEY = "ray_data_tf_shards"

Columns = str | list[str]


def _names(value: Any, key: str) -> Columns:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, Sequence)
        and value
        and all(isinstance(v, str) for v in value)
        and len(set(value)) == len(value)
    ):
        return list(value)
    raise ConfigTypeError(
        f"dataset_columns[{key!r}] must be a column name or a non-empty list of distinct "
        f"column names; got {value!r}."
    )


def resolve_columns(
    dataset_columns: Mapping[str, Any] | None, names: Sequence[str]
) -> tuple[Columns, Columns]:
    """``(features, label)`` for a data set with columns ``names`` (pure; driver).

    Without ``dataset_columns`` the last column is the label and the others are the
    features: one feature column gives its name (Keras gets a tensor), several a list
    (Keras gets a dict keyed by name). A missing key of ``dataset_columns`` is filled
    the same way: the label defaults to the last column not among the features, the
    features to every column but the label.

    Raises:
        ConfigTypeError: ``dataset_columns`` is not a dict, or a value is not a name or list.
        ConfigError: an unknown key, a column the data set lacks, a column used as both
            feature and label, or fewer than two columns to split.
    """
    spec = {} if dataset_columns is None else dataset_columns
    if not isinstance(spec, Mapping):
        raise ConfigTypeError(
            f"dataset_columns must be a dict like {{'features': 'x', 'label': 'y'}}; got "
            f"{type(spec).__name__}."
        )
    unknown = sorted(set(spec) - set(COLUMN_KEYS))
    if unknown:
        raise ConfigError(f"dataset_columns takes the keys {COLUMN_KEYS}; got {sorted(spec)}.")
    features = _names(spec["features"], "features") if "features" in spec else None
    label = _names(spec["label"], "label") if "label" in spec else None
    chosen = _as_list(features) + _as_list(label)
    missing = [name for name in chosen if name not in names]
    if missing:
        raise ConfigError(
            f"dataset_columns names {missing}, which the data set does not have; its columns "
            f"are {list(names)}."
        )
    if label is None:
        rest = [name for name in names if name not in _as_list(features)]
        label = rest[-1] if rest else None
    if features is None:
        rest = [name for name in names if name not in _as_list(label)]
        features = rest[0] if len(rest) == 1 else (rest or None)
    if features is None or label is None:
        raise ConfigError(
            f"Training from datasets= needs a feature and a label column; the data set has "
            f"{list(names)}. Add columns, or set dataset_columns={{'features': ..., 'label': ...}}."
        )
    overlap = sorted(set(_as_list(features)) & set(_as_list(label)))
    if overlap:
        raise ConfigError(f"Columns {overlap} are given as both features and label; pick one.")
    return features, label


def _as_list(columns: Columns | None) -> list[str]:
    if columns is None:
        return []
    return [columns] if isinstance(columns, str) else list(columns)


def check_columns(
    datasets: Mapping[str, Any], dataset_columns: Mapping[str, Any] | None
) -> tuple[Columns, Columns]:
    """Driver: the ``(features, label)`` columns, checked against every data set's schema.

    Raises:
        ConfigError: see :func:`resolve_columns`; also a column the validation data lacks.
    """
    features, label = resolve_columns(dataset_columns, datasets["train"].schema().names)
    for key, dataset in datasets.items():
        names = dataset.schema().names
        missing = [c for c in _as_list(features) + _as_list(label) if c not in names]
        if missing:
            raise ConfigError(
                f"datasets[{key!r}] lacks the columns {missing} that training reads; its "
                f"columns are {list(names)}. Give every data set the same columns."
            )
    return features, label


def turn_off_auto_shard(backend: Any) -> None:
    """Driver: set the backend's ``auto_shard_policy`` to "off" (each worker holds its own split).

    Raises:
        ConfigError: ``auto_shard_policy`` was set to "file" or "auto", which cannot apply.
    """
    config = backend.config
    policy = getattr(config, "auto_shard_policy", None)
    if policy is None or policy == "off":
        return
    if policy != "data":  # "data" is the default: only "file" and "auto" were asked for
        raise ConfigError(
            f"auto_shard_policy={policy!r} does not apply to datasets=: every worker already "
            f"reads only its own split of each Ray Dataset (the policy is 'off'). Drop "
            f"auto_shard_policy from backend_config."
        )
    # A copy: the caller's config object (which may be shared) keeps its value.
    backend.config = dataclasses.replace(config, auto_shard_policy="off")


def receive_shards(shards: dict[str, Any], columns: tuple[Columns, Columns]) -> None:
    """Worker: keep this worker's splits and columns for :func:`shard_datasets`."""
    from polytrain.launchers.worker import WORKER_STATE

    WORKER_STATE[_KEY] = (shards, columns)


def shard_datasets(config: dict[str, Any]) -> tuple[Any, Any]:
    """Worker: the ``data_creator`` of a TFTrainer given ``datasets=``: this worker's tf.data sets.

    Raises:
        ConfigError: ``config["batch_size"]`` is missing or not a positive int.
    """
    from polytrain.launchers.worker import WORKER_STATE

    batch = config.get("batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError(
            f"Training from datasets= needs config['batch_size'], the global batch as a "
            f"positive int; got {batch!r}. Add it to the config."
        )
    shards, (features, label) = WORKER_STATE[_KEY]

    def to_tf(key: str) -> Any:
        iterator, _ = shards[key]
        # to_tf sets auto-sharding off itself; its generator starts a new pass over the
        # split (a new streaming_split epoch, in step with the other workers) every time
        # Keras iterates the data set.
        return iterator.to_tf(
            feature_columns=features,
            label_columns=label,
            batch_size=batch,
            drop_last=key == "train",
        )

    return to_tf("train"), (to_tf("val") if "val" in shards else None)
