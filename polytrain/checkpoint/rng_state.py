"""A worker's random number generators, saved with its part of a checkpoint directory.

Dropout, random augmentation and a shuffling ``RandomSampler`` draw from the
process's global generators: torch's (CPU and every CUDA device), NumPy's legacy
global one and Python's ``random``. A checkpoint that is to resume *exactly*
(the next batch trained as an uninterrupted run would have trained it) carries
each rank's states; every rank restores its own. The states are plain JSON
(base64 for the byte states), stored in the rank's index file: loading them
unpickles nothing.

Only a checkpoint written at the same world size restores them: at another
world size there is no rank-to-rank correspondence, and the streams start as
the new workers' seeds make them (the data order stays exact either way: the
distributed sampler's shuffle depends on its seed and epoch only).
"""

from __future__ import annotations

import base64
import random
import sys
from typing import Any

from polytrain.errors import CheckpointError

FORMAT = 1


def _bytes_of(tensor: Any) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _tensor_of(text: str) -> Any:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's generator states, JSON-serialisable."""
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "format": FORMAT,
        "torch": _bytes_of(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "cuda": [],
        "numpy": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_of(s) for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to a :func:`capture`'d state.

    Raises:
        CheckpointError: ``state`` is not a state this module wrote (a ``ValueError``).
    """
    import torch

    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"Not a random-state record of format {FORMAT}: {str(state)[:80]!r}. It comes from "
            f"another polytrain version; load the checkpoint without its random states."
        )
    torch.set_rng_state(_tensor_of(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_tensor_of(s) for s in cuda])
    if state.get("numpy") is not None:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state(
            (kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)
        )
