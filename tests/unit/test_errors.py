"""A worker's exception reaches the driver as a WorkerError that keeps its class (no Ray)."""

from __future__ import annotations

import copy
import pickle

import pytest

from polytrain.errors import PolytrainError, WorkerError, worker_error_like


class CustomError(ValueError):
    def __init__(self, code, detail):
        super().__init__(code)
        self.detail = detail


@pytest.mark.parametrize(
    "cause", [ValueError("bad"), KeyError("k"), CustomError(3, "x"), FloatingPointError("nan")]
)
def test_worker_error_is_also_the_original_class(cause):
    error = worker_error_like(cause, "Worker rank 1 raised: bad", rank=1, remote_traceback="tb")
    assert isinstance(error, type(cause)) and isinstance(error, WorkerError)
    assert isinstance(error, PolytrainError)
    assert (error.rank, error.remote_traceback, str(error)) == (
        1,
        "tb",
        "Worker rank 1 raised: bad",
    )
    with pytest.raises(type(cause)):
        raise error
    for clone in (copy.copy(error), pickle.loads(pickle.dumps(error))):
        assert type(clone) is type(error) and clone.rank == 1 and clone.remote_traceback == "tb"


@pytest.mark.parametrize("cause", [OSError("io"), KeyboardInterrupt(), SystemExit(1)])
def test_classes_that_cannot_be_combined_give_a_plain_worker_error(cause):
    error = worker_error_like(cause, "Worker rank 0 raised", rank=0)
    assert type(error) is WorkerError and error.rank == 0
