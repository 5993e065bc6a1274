"""Which Keras to use with TensorFlow: ``tf_keras`` (Keras 2), never Keras 3.

TensorFlow's ``MultiWorkerMirroredStrategy`` fails inside Keras 3's ``model.fit``
(it cannot convert the strategy's per-replica values), while ``tf_keras`` trains
correctly under it. TensorFlow >= 2.16 resolves ``tf.keras`` to Keras 3 unless
``TF_USE_LEGACY_KERAS=1`` is set *before TensorFlow is imported*, so the
TensorFlow backend starts its workers with that variable and builds models with
the module :func:`get_keras` returns.

Nothing here imports TensorFlow or Keras at module import time, and nothing of
polytrain above the ground floor (compat and errors) is imported: the trainer's
creators (on the driver and in the workers) and the TensorFlow backend's
strategy share :func:`check_keras_model` from here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from polytrain.compat.imports import require
from polytrain.errors import CheckpointError, CreatorError, CreatorTypeError

#: The environment variable that makes ``tf.keras`` resolve to ``tf_keras``.
LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"

#: What every TensorFlow worker must start with (set before TensorFlow is imported).
LEGACY_KERAS_ENV = {LEGACY_KERAS_VAR: "1"}

#: How to fix a model built with Keras 3, for error messages.
KERAS3_FIX = (
    "Build the model with tf_keras (Keras 2): `import tf_keras as keras` in the creator, or use "
    "`tf.keras` with TF_USE_LEGACY_KERAS=1 set before TensorFlow is imported (polytrain sets it "
    "in its workers; in your own driver process set it at the top of the script or in the "
    "shell). Keras 3 models fail under MultiWorkerMirroredStrategy."
)


def get_keras() -> ModuleType:
    """The Keras module that works with ``MultiWorkerMirroredStrategy``: ``tf_keras``.

    Raises:
        MissingDependencyError: tf_keras is not installed (with the install command).
    """
    return require("tf_keras", "TFTrainer (Keras models under MultiWorkerMirroredStrategy)")


def keras_flavor(obj: Any) -> str | None:
    """``"tf_keras"``, ``"keras3"`` or ``None`` (not a Keras object) for a model or optimizer.

    Answered from the classes' modules, so it imports nothing.
    """
    for cls in type(obj).__mro__:
        root = cls.__module__.split(".")[0]
        if root == "tf_keras":
            return "tf_keras"
        if root == "keras":
            # Keras 2 inside TensorFlow < 2.16 lived at ``keras.src`` too; only Keras 3 has
            # ``keras.src.models``.
            keras_module = sys.modules.get("keras")
            major = str(getattr(keras_module, "__version__", "3")).split(".")[0]
            return "keras3" if not major.isdigit() or int(major) >= 3 else "tf_keras"
    return None


def is_legacy_keras_model(obj: Any) -> bool:
    """True when ``obj`` is a ``tf_keras`` (Keras 2) model."""
    if keras_flavor(obj) != "tf_keras":
        return False
    return isinstance(obj, get_keras().Model)


def check_keras_model(model: Any, creator: str) -> None:
    """Raise a :class:`~polytrain.errors.CreatorError` unless ``model`` is a compiled tf_keras model.

    Args:
        model: what ``creator`` returned.
        creator: the creator's name, for the message (e.g. ``"model_creator"``).
    """
    if keras_flavor(model) == "keras3":
        raise CreatorTypeError(
            f"{creator} returned a Keras 3 model ({type(model).__module__}."
            f"{type(model).__qualname__}); TFTrainer needs a tf_keras (Keras 2) model. "
            f"{KERAS3_FIX}"
        )
    if not isinstance(model, get_keras().Model):
        text = repr(model)
        text = text[:77] + "..." if len(text) > 80 else text
        raise CreatorTypeError(
            f"{creator} returned {type(model).__name__} ({text}); expected a compiled "
            f"tf_keras Model. Signature: model_creator(config) -> keras.Model (compiled)."
        )
    if getattr(model, "optimizer", None) is None:
        raise CreatorError(
            f"{creator} returned an uncompiled model ({type(model).__name__}); call "
            f"model.compile(optimizer=..., loss=..., metrics=[...]) inside {creator}."
        )


@contextlib.contextmanager
def legacy_keras_env() -> Iterator[None]:
    """Set ``TF_USE_LEGACY_KERAS=1`` for the duration of the block, then restore it.

    This only changes what ``tf.keras`` means if TensorFlow has not resolved
    ``tf.keras`` in this process yet (it caches the choice on first use).
    """
    previous = os.environ.get(LEGACY_KERAS_VAR)
    os.environ[LEGACY_KERAS_VAR] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LEGACY_KERAS_VAR, None)
        else:
            os.environ[LEGACY_KERAS_VAR] = previous


# ------------------------------------------------------- optimizer variables
def _optimizer_variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def optimizer_weights(optimizer: Any) -> list[Any] | None:
    """The optimizer's variables (iterations and slots) as numpy arrays; None if not built."""
    variables = _optimizer_variables(optimizer)
    if not variables:
        return None
    return [v.numpy().copy() for v in variables]


def set_optimizer_weights(optimizer: Any, model: Any, values: list[Any] | None) -> None:
    """Build the optimizer's slots for ``model`` if needed and assign ``values`` to them.

    ``None`` keeps a fresh optimizer state (the weights still load).

    Raises:
        CheckpointError: ``values`` do not match the optimizer's variables in number or shape.
    """
    if values is None:
        return
    if not _optimizer_variables(optimizer) or len(_optimizer_variables(optimizer)) < len(values):
        if hasattr(optimizer, "build"):
            optimizer.build(model.trainable_variables)
        else:  # legacy optimizers create their slots on the first apply
            optimizer._create_all_weights(model.trainable_variables)
    variables = _optimizer_variables(optimizer)
    if len(variables) != len(values):
        raise CheckpointError(
            f"The checkpoint has {len(values)} optimizer variables but "
            f"{type(optimizer).__name__} has {len(variables)}: the optimizer in model_creator "
            f"differs from the one that wrote the checkpoint."
        )
    for variable, value in zip(variables, values, strict=True):
        if tuple(variable.shape) != tuple(value.shape):
            raise CheckpointError(
                f"Optimizer variable {variable.name} has shape {tuple(variable.shape)}; the "
                f"checkpoint's value has shape {tuple(value.shape)}."
            )
        variable.assign(value)
