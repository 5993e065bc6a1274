"""Worker side: the environment Accelerate reads while a torch loop runs, and the check of what it built.

Accelerate (and the HF ``Trainer`` and TRL trainers, which build an
``Accelerator``) takes its setup from the environment that ``accelerate launch``
would give a script. Around every torch ``train_loop_per_worker`` call each
worker gets:

- ``ACCELERATE_TORCH_DEVICE``: the worker's device (``cuda:N`` or ``cpu``), as Ray
  Train sets it, so ``Accelerator().device == polytrain.train.torch.get_device()``;
- ``ACCELERATE_USE_CPU=true`` on CPU workers: without it Accelerate finds no device
  backend on a CPU and runs every worker as one process of its own (the reason Ray
  Train's CPU tests pass ``Accelerator(cpu=True)``); with it, Accelerate's
  ``MULTI_CPU`` mode joins the worker group's gloo process group;
- ``ACCELERATE_MIXED_PRECISION`` with the trainer's ``use_fp16`` (fp16 on GPUs,
  bf16 on CPUs);
- the backend's own variables (:meth:`~polytrain.backends.core.backend.Backend.accelerate_env`):
  ``FSDP_*`` for fsdp, the DeepSpeed config for deepspeed.

The torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
...) are already there from the process group's rendezvous. When the loop ends
the variables are restored and Accelerate's process-wide state is reset, so a
reused worker starts clean.

A backend Accelerate cannot follow (horovod, fairscale; fsdp and deepspeed on CPU)
is refused where Accelerate is used: by ``prepare_trainer``, by
``RayTrainReportCallback`` when training starts, and by ``report()`` once an
``Accelerator`` exists (:func:`check_accelerator`), which also refuses an
Accelerate setup that contradicts the backend (an FSDP plugin on ddp, ...).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.errors import ConfigError
from polytrain.launchers.worker import WORKER_STATE

_KEY = "polytrain_accelerate_scope"
_ONE_PROCESS = ("NO", "MULTI_CPU", "MULTI_GPU")


@dataclass
class AccelerateScope:
    """What Accelerate should build in this worker's loop.

    Attributes:
        backend: the backend's name.
        world_size: the number of workers.
        expected: Accelerate's ``DistributedType`` name for the backend (``"MULTI_CPU"``,
            ``"MULTI_GPU"``, ``"FSDP"``, ``"DEEPSPEED"``, ``"NO"`` for one worker).
        refusal: why Accelerate cannot train on this backend here (None: it can).
        checked: whether :func:`check_accelerator` has passed an ``Accelerator`` already.
    """

    backend: str
    world_size: int
    expected: str
    refusal: str | None = None
    checked: bool = False


def loop_env(backend: Backend, ctx: WorkerContext) -> tuple[dict[str, str], AccelerateScope]:
    """The Accelerate variables of one worker's loop, and what Accelerate should build with them."""
    env = {"ACCELERATE_TORCH_DEVICE": str(ctx.device)}
    on_cpu = ctx.device.type == "cpu"
    if on_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if ctx.use_fp16:
        env["ACCELERATE_MIXED_PRECISION"] = "bf16" if on_cpu else "fp16"
    refusal = None
    try:
        env.update(backend.accelerate_env(ctx.use_gpu))
    except ConfigError as error:
        refusal = str(error)
    if env.get("ACCELERATE_USE_FSDP") == "true":
        expected = "FSDP"
    elif env.get("ACCELERATE_USE_DEEPSPEED") == "true":
        expected = "DEEPSPEED"
    elif ctx.world_size <= 1:
        expected = "NO"
    else:
        expected = "MULTI_CPU" if on_cpu else "MULTI_GPU"
    name = backend.name or type(backend).__name__
    return env, AccelerateScope(name, ctx.world_size, expected, refusal)


@contextlib.contextmanager
def accelerate_scope(backend: Backend, ctx: WorkerContext) -> Iterator[AccelerateScope]:
    """Worker: run the loop with Accelerate's variables set; restore them and reset Accelerate after."""
    env, scope = loop_env(backend, ctx)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    WORKER_STATE[_KEY] = scope
    try:
        yield scope
    finally:
        WORKER_STATE.pop(_KEY, None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reset_accelerate()


def _reset_accelerate() -> None:
    """Forget Accelerate's process-wide state (its process group is gone with the loop's group)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


def get_scope() -> AccelerateScope | None:
    """Worker: the running torch loop's scope (None outside one, or in a TensorFlow loop)."""
    return WORKER_STATE.get(_KEY)


def refuse_if_unsupported(scope: AccelerateScope, what: str) -> None:
    """Raise the backend's refusal, if it has one, naming what tried to use Accelerate."""
    if scope.refusal is not None:
        raise ConfigError(f"{what}: {scope.refusal}")


def check_state(scope: AccelerateScope, state: Any, what: str) -> None:
    """Compare an ``AcceleratorState`` with what the backend needs.

    Raises:
        ConfigError: the backend's refusal; or Accelerate set up another distributed
            type or another number of processes than the backend and the group.
    """
    refuse_if_unsupported(scope, what)
    found = getattr(state.distributed_type, "name", str(state.distributed_type))
    # One worker is one process whichever plain mode Accelerate picked (NO, or MULTI_CPU
    # of one when RANK / WORLD_SIZE are set).
    alike = scope.expected == "NO" and found in _ONE_PROCESS
    if not (found == scope.expected or alike) or state.num_processes != scope.world_size:
        raise ConfigError(
            f"{what}: Accelerate set up {found} over {state.num_processes} process(es), but the "
            f"{scope.backend} backend trains as {scope.expected} over {scope.world_size} "
            f"worker(s). An Accelerate setting in the script contradicts the backend (an "
            f"fsdp_plugin / deepspeed_plugin passed to Accelerator(), TrainingArguments(fsdp=..., "
            f"deepspeed=...), cpu=False on a CPU worker): drop it and let the backend choose "
            f"(polytrain sets Accelerate's environment from backend and backend_config), or "
            f"pick the backend that matches it."
        )
    scope.checked = True


def check_accelerator() -> None:
    """Worker, at every ``report()``: refuse an ``Accelerator`` that does not train as the backend does.

    Costs two dictionary look-ups until the loop creates an ``Accelerator``, and
    nothing once one has passed.

    Raises:
        ConfigError: see :func:`check_state`.
    """
    scope = get_scope()
    if scope is None or scope.checked:
        return
    module = sys.modules.get("accelerate.state")
    if module is None or not module.AcceleratorState._shared_state:
        return
    check_state(scope, module.AcceleratorState(), "The Accelerator in train_loop_per_worker")
