"""What Ray Train's ``ray.train.tests.util`` gives its tests: checkpoints of a small dict."""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Iterator

from polytrain.train import Checkpoint


@contextlib.contextmanager
def dict_checkpoint(data: dict) -> Iterator[Checkpoint]:
    """A checkpoint of ``data`` (pickled as ``data.pkl``) in a temporary directory."""
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "data.pkl"), "wb") as handle:
            pickle.dump(data, handle)
        yield Checkpoint.from_directory(directory)


def load_dict(checkpoint: Checkpoint) -> dict:
    """The dict of a :func:`dict_checkpoint`."""
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "data.pkl"), "rb") as handle:
            return pickle.load(handle)
