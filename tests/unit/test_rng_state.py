"""rng_state: a process's generator states as JSON, restored exactly (no unpickling)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from polytrain.checkpoint import rng_state


def _draw() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_capture_and_restore_replay_every_generator():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    saved = json.loads(json.dumps(rng_state.capture()))  # it survives a JSON round trip
    first = _draw()
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    rng_state.restore(saved)
    assert _draw() == first


def test_a_foreign_record_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="another polytrain version"):
        rng_state.restore({"format": 999})
