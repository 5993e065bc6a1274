"""``TorchCheckpoint``: Ray Train's checkpoint of a torch model or state dict."""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

import torch

from polytrain.checkpoint.storage import Storage
from polytrain.errors import CheckpointError, ConfigTypeError
from polytrain.train.checkpoint import Checkpoint

#: The state dict (``from_state_dict``; also written by ``from_model``).
MODEL_FILENAME = "model.pt"
#: The pickled module of ``from_model`` (what ``get_model()`` without a model unpickles).
MODULE_FILENAME = "module.pt"
PREPROCESSOR_FILENAME = "preprocessor.pkl"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / ``accelerate(amp=True)``'s wrapper (saved unwrapped)."""
    wrapped = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, wrapped) or getattr(model, "_polytrain_wrapper", False):
        model = model.module
    return model


def _pickle_module() -> Any:
    """cloudpickle where Ray has it: a model class defined inside the loop pickles by value."""
    try:
        from ray import cloudpickle

        return cloudpickle
    except ImportError:  # local mode without Ray: plain pickle (module-level classes)
        return pickle


class TorchCheckpoint(Checkpoint):
    """A checkpoint holding a torch model (Ray Train's ``TorchCheckpoint``).

    ``from_state_dict`` writes ``model.pt`` (the state dict); ``from_model`` writes the
    unwrapped model's state dict there too, and the pickled module as ``module.pt``.
    ``get_model(model)`` loads the state dict into ``model`` with
    ``torch.load(weights_only=True)``; ``get_model()`` without a model unpickles the
    module (only do that with checkpoints you trust: unpickling runs code).
    """

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], *, preprocessor: Any = None
    ) -> TorchCheckpoint:
        """A checkpoint of ``state_dict`` in a new temporary directory."""
        if not isinstance(state_dict, dict):
            raise ConfigTypeError(
                f"TorchCheckpoint.from_state_dict takes a state dict; got "
                f"{type(state_dict).__name__}. For a module use from_model."
            )
        directory = tempfile.mkdtemp(prefix="torch_checkpoint_")
        torch.save(state_dict, os.path.join(directory, MODEL_FILENAME))
        checkpoint = cls.from_directory(directory)
        if preprocessor is not None:
            checkpoint.set_preprocessor(preprocessor)
        return checkpoint

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, preprocessor: Any = None) -> TorchCheckpoint:
        """A checkpoint of ``model`` (unwrapped from DDP) in a new temporary directory."""
        if not isinstance(model, torch.nn.Module):
            raise ConfigTypeError(
                f"TorchCheckpoint.from_model takes a torch.nn.Module; got {type(model).__name__}."
            )
        model = _unwrap(model)
        checkpoint = cls.from_state_dict(model.state_dict(), preprocessor=preprocessor)
        torch.save(
            model,
            os.path.join(checkpoint.location, MODULE_FILENAME),
            pickle_module=_pickle_module(),
        )
        return checkpoint

    def get_model(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """The model: ``model`` with the saved weights, or the saved module (unpickled).

        Raises:
            CheckpointError: no state dict / module in the checkpoint, or ``model`` is None
                for a checkpoint written by ``from_state_dict``.
        """
        with self.as_directory() as directory:
            if model is not None:
                path = os.path.join(directory, MODEL_FILENAME)
                if not os.path.exists(path):
                    raise CheckpointError(f"{self!r} holds no {MODEL_FILENAME}.")
                state = torch.load(path, map_location="cpu", weights_only=True)
                _unwrap(model).load_state_dict(state)
                return model
            path = os.path.join(directory, MODULE_FILENAME)
            if not os.path.exists(path):
                raise CheckpointError(
                    f"{self!r} holds a state dict, not a module: pass the model to load it into, "
                    f"get_model(MyModel())."
                )
            return torch.load(path, map_location="cpu", weights_only=False)

    def set_preprocessor(self, preprocessor: Any) -> None:
        """Store a (Ray Data) preprocessor with the checkpoint (pickled)."""
        Storage(self.location).write_bytes(PREPROCESSOR_FILENAME, pickle.dumps(preprocessor))

    def get_preprocessor(self) -> Any:
        """The stored preprocessor (unpickled), or None."""
        with self.as_directory() as directory:
            path = os.path.join(directory, PREPROCESSOR_FILENAME)
            if not os.path.exists(path):
                return None
            with open(path, "rb") as handle:
                return pickle.load(handle)  # noqa: S301 - the user's own checkpoint, as Ray does
