"""``TensorflowCheckpoint``: Ray Train's checkpoint of a Keras model (TensorFlow imported on use)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from polytrain.errors import CheckpointError, ConfigError
from polytrain.train.checkpoint import Checkpoint


class TensorflowCheckpoint(Checkpoint):
    """A checkpoint holding a Keras model (Ray Train's ``TensorflowCheckpoint``).

    The model's file name is kept in the checkpoint's metadata (``_model_filename``),
    as Ray Train writes it, so checkpoints of either load with :meth:`get_model`.
    """

    MODEL_FILENAME_KEY = "_model_filename"

    @classmethod
    def from_model(cls, model: Any, *, preprocessor: Any = None) -> TensorflowCheckpoint:
        """A checkpoint of a Keras model (saved as ``model.keras``) in a new temporary directory."""
        _no_preprocessor(preprocessor)
        directory = tempfile.mkdtemp(prefix="tf_checkpoint_")
        filename = "model.keras"
        model.save(Path(directory, filename).as_posix())
        checkpoint = cls.from_directory(directory)
        checkpoint.update_metadata({cls.MODEL_FILENAME_KEY: filename})
        return checkpoint

    @classmethod
    def from_h5(cls, file_path: str, *, preprocessor: Any = None) -> TensorflowCheckpoint:
        """A checkpoint of a saved ``.h5`` model file (copied)."""
        _no_preprocessor(preprocessor)
        if not os.path.isfile(file_path) or not file_path.endswith(".h5"):
            raise CheckpointError(f"from_h5({file_path!r}): not an existing .h5 file.")
        directory = tempfile.mkdtemp(prefix="tf_checkpoint_")
        filename = os.path.basename(file_path)
        shutil.copy(file_path, Path(directory, filename).as_posix())
        checkpoint = cls.from_directory(directory)
        checkpoint.update_metadata({cls.MODEL_FILENAME_KEY: filename})
        return checkpoint

    @classmethod
    def from_saved_model(cls, dir_path: str, *, preprocessor: Any = None) -> TensorflowCheckpoint:
        """A checkpoint of a SavedModel directory (copied)."""
        _no_preprocessor(preprocessor)
        directory = tempfile.mkdtemp(prefix="tf_checkpoint_")
        shutil.copytree(dir_path, directory, dirs_exist_ok=True)
        checkpoint = cls.from_directory(directory)
        checkpoint.update_metadata({cls.MODEL_FILENAME_KEY: "."})
        return checkpoint

    def get_model(self) -> Any:
        """The Keras model (``keras.models.load_model``).

        Raises:
            CheckpointError: the checkpoint's metadata names no model file.
        """
        import tensorflow as tf

        filename = self.get_metadata().get(self.MODEL_FILENAME_KEY)
        if filename is None:
            raise CheckpointError(
                f"{self!r} names no model file in its metadata ({self.MODEL_FILENAME_KEY}); "
                f"write it with TensorflowCheckpoint.from_model / from_h5 / from_saved_model."
            )
        with self.as_directory() as directory:
            return tf.keras.models.load_model(Path(directory, filename).as_posix())


def _no_preprocessor(preprocessor: Any) -> None:
    if preprocessor is not None:
        raise ConfigError(
            "TensorflowCheckpoint(preprocessor=...) is not supported (removed from Ray Train "
            "2.x): apply the preprocessor to the datasets before training."
        )
