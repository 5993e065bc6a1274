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


# Every exception class polytrain defines, and the built-in classes it is also an instance of
# (besides Exception): what `except ValueError` / `pytest.raises(TypeError)` in a user's code
# catches. RaySGD raised ValueError for a creator's unusable value; Python raises TypeError for
# a call with the wrong arguments or an object of the wrong type.
EXPECTED_BUILTINS = {
    "polytrain.errors.PolytrainError": set(),
    "polytrain.errors.WorkerError": {RuntimeError},
    "polytrain.errors.WorkerDiedError": {RuntimeError},
    "polytrain.errors.WorkerHangError": {RuntimeError},
    "polytrain.errors.InsufficientResourcesError": {RuntimeError},
    "polytrain.errors.TrainerShutdownError": {RuntimeError},
    "polytrain.errors.CheckpointError": {ValueError},
    "polytrain.errors.CreatorError": {ValueError},
    "polytrain.errors.CreatorTypeError": {ValueError, TypeError},
    "polytrain.errors.ConfigError": {ValueError},
    "polytrain.errors.ConfigTypeError": {ValueError, TypeError},
    "polytrain.errors.UnknownBackendError": {ValueError},
    "polytrain.errors.MissingDependencyError": {ImportError},
    "polytrain.errors.RunStoppedError": {RuntimeError},
    "polytrain.errors.TerminatedError": {RuntimeError},
    "polytrain.errors.DrainLimitError": {RuntimeError},
    "polytrain.trainer_api.torch.operator.NonFiniteLossError": {
        FloatingPointError,
        ArithmeticError,
    },
    "polytrain.trainer_api.torch.default_step.MissingLossError": {ValueError},
    "polytrain.trainer_api.torch.step_record.StepOptionError": {ValueError},
    "polytrain.train.preemption.LoopPreempted": set(),  # control flow inside the loop
    "polytrain.cli.launch_runner.ScriptFailedError": {RuntimeError},
    "polytrain.train.session.SessionMisuseError": {RuntimeError},
    "polytrain.runs.workload.CallStoppedForDrain": set(),  # control flow inside the run loop
    "polytrain.lightning.drain_stop.DrainStop": {SystemExit},  # Lightning's SIGTERMException
    "polytrain.loggers.base.LoggerError": {RuntimeError},
    # Ray Train's names (polytrain.train); catching RuntimeError also catches a failed run
    "polytrain.train.errors.TrainingFailedError": {RuntimeError},
    "polytrain.train.errors.WorkerGroupError": {RuntimeError},
    "polytrain.train.errors.NCCLHangError": {RuntimeError},
    "polytrain.train.errors.ControllerError": {RuntimeError},
    "polytrain.train.errors.PreemptionError": {RuntimeError},
    "polytrain.train.errors.DeprecatedOptionError": {ValueError, DeprecationWarning, Warning},
    "polytrain.hf.data.templates.TemplateError": {ValueError},
}


def _defined_exception_classes() -> set[str]:
    """``module.Class`` of every class in polytrain/ with a base named ``*Error`` / ``*Exception``."""
    import ast
    from pathlib import Path

    import polytrain

    root = Path(polytrain.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith(("Error", "Exception")) for base in node.bases
            ):
                found.add(f"{module}.{node.name}")
    return found


def test_the_table_names_every_exception_class():
    assert _defined_exception_classes() == set(EXPECTED_BUILTINS)


@pytest.mark.parametrize("name", sorted(EXPECTED_BUILTINS))
def test_every_error_is_a_polytrain_error_and_its_builtin_kind(name):
    import importlib

    module_name, _, class_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, PolytrainError)
    builtins = {c for c in cls.__mro__ if c.__module__ == "builtins"}
    assert builtins - {object, BaseException, Exception} == EXPECTED_BUILTINS[name]


def test_creator_errors_are_value_errors_and_wrong_types_type_errors():
    """RaySGD raised ValueError for several models with the default step; `except ValueError` catches ours."""
    from types import SimpleNamespace

    from polytrain.errors import CreatorError, CreatorTypeError
    from polytrain.trainer_api.creators import TorchCreators
    from polytrain.trainer_api.torch.operator import TrainingOperator

    several = SimpleNamespace(models=[object()] * 3, optimizers=[object()])
    with pytest.raises(ValueError, match="model_creator returned 3 objects") as info:
        TrainingOperator.check_single_model(several)
    assert isinstance(info.value, CreatorError) and not isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="must be callable"):
        TorchCreators("not a function", None, lambda model, config: None, None, None)
    with pytest.raises(CreatorTypeError):
        TorchCreators(lambda config: None, None, "sgd", None, None)
