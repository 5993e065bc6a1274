"""The pure parts of TFTrainer's Ray Data input: column choice and the auto-shard policy."""

from __future__ import annotations

import pytest

from polytrain.backends.tensorflow.backend import MultiWorkerMirroredBackend
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.tensorflow.ray_data import resolve_columns, turn_off_auto_shard


@pytest.mark.parametrize(
    ("spec", "names", "expected"),
    [
        (None, ["x", "y"], ("x", "y")),  # the torch convention: label last
        (None, ["a", "b", "y"], (["a", "b"], "y")),  # several features: a dict for Keras
        ({"label": "a"}, ["a", "b", "c"], (["b", "c"], "a")),
        ({"label": ["a", "c"]}, ["a", "b", "c"], ("b", ["a", "c"])),
        ({"features": "b"}, ["a", "b", "c"], ("b", "c")),
        ({"features": ["c"], "label": "a"}, ["a", "b", "c"], (["c"], "a")),  # b unused
    ],
)
def test_columns_default_to_label_last_and_follow_the_mapping(spec, names, expected):
    assert resolve_columns(spec, names) == expected


@pytest.mark.parametrize(
    ("spec", "names", "error", "match"),
    [
        ({"labels": "y"}, ["x", "y"], ConfigError, r"takes the keys \('features', 'label'\)"),
        ({"label": "z"}, ["x", "y"], ConfigError, r"names \['z'\], which the data set does not"),
        ({"features": "x", "label": "x"}, ["x", "y"], ConfigError, "both features and label"),
        ({"label": 3}, ["x", "y"], ConfigTypeError, r"dataset_columns\['label'\] must be"),
        ({"features": []}, ["x", "y"], ConfigTypeError, "non-empty list"),
        (["x", "y"], ["x", "y"], ConfigTypeError, "must be a dict"),
        (None, ["only"], ConfigError, "needs a feature and a label column"),
    ],
)
def test_bad_columns_name_the_value_and_the_fix(spec, names, error, match):
    with pytest.raises(error, match=match):
        resolve_columns(spec, names)


def test_auto_shard_turns_off_without_touching_the_callers_config():
    backend = MultiWorkerMirroredBackend()
    given = backend.config
    turn_off_auto_shard(backend)
    assert backend.config.auto_shard_policy == "off"
    assert given.auto_shard_policy == "data"
    with pytest.raises(ConfigError, match="auto_shard_policy='file' does not apply"):
        turn_off_auto_shard(MultiWorkerMirroredBackend({"auto_shard_policy": "file"}))
