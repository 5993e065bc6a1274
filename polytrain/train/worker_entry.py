"""What the function API runs inside every worker: set up the session, run the user's loop."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
from polytrain.errors import worker_error_like
from polytrain.train import session as train_session
from polytrain.train.checkpoint import Checkpoint
from polytrain.train.preemption import LoopPreempted, LoopStopped


@dataclass
class LoopSpec:
    """Everything a worker needs to run the loop (sent once per group start)."""

    fn: Any
    config: dict[str, Any]
    takes_config: bool
    backend: Backend
    context: WorkerContext
    board: Any
    run_url: str
    experiment_name: str
    trial_name: str | None = None
    #: Ray Train's options the loop's functions read (:meth:`~polytrain.train.extras.RunExtras.worker_options`).
    options: dict[str, Any] = field(default_factory=dict)


_SPEC = "polytrain_train_spec"


def setup_session(
    spec: LoopSpec, rank_info: Any, device_index: int, shards: dict[str, Any]
) -> None:
    """Worker: place this worker, make the backend's strategy, and hold the session."""
    from polytrain.launchers.worker import WORKER_STATE

    if spec.backend.framework == "tensorflow":
        # No torch in a TensorFlow worker; the loop builds its tf.distribute strategy.
        ctx = spec.context.for_rank(rank_info)
    else:
        ctx = spec.context.place(rank_info, device_index)
        if not ctx.local_mode:
            import torch

            torch.set_num_threads(max(1, int(ctx.num_cpus)))
    context = train_session.TrainContext(
        world_rank=ctx.world_rank,
        world_size=ctx.world_size,
        local_rank=ctx.local_rank,
        local_world_size=ctx.local_world_size,
        node_rank=ctx.node_rank,
        experiment_name=spec.experiment_name,
        trial_name=spec.trial_name,
        storage_path=spec.run_url,
    )
    strategy = spec.backend.make_strategy()
    WORKER_STATE[_SPEC] = (
        spec,
        train_session.Session(
            context=context,
            worker_context=ctx,
            board=spec.board,
            run_url=spec.run_url,
            dataset_shards=shards,
            strategy=strategy,
            backend=spec.backend,
            options=dict(spec.options),
        ),
    )
    level = spec.options.get("log_level")
    if level:
        logging.getLogger("polytrain").setLevel(level)


def _library_env(spec: LoopSpec, session: train_session.Session) -> Any:
    """The environment Accelerate (the HF Trainer, TRL) reads in a torch loop; none for TensorFlow."""
    backend = getattr(spec, "backend", None)  # (a spec made by hand in a test may have none)
    if backend is None or backend.framework != "torch":
        return contextlib.nullcontext()
    from polytrain.train.huggingface.accelerate_scope import accelerate_scope

    return accelerate_scope(backend, session.worker_context)


def run_loop(start_index: int, checkpoint_url: str | None) -> LoopStopped | None:
    """Worker: run the user's function once, from step ``start_index`` and that checkpoint.

    Returns:
        None when the function returned; :class:`LoopStopped` when ``report()`` ended it
        at the checkpoint reported after a drain (every rank stops at the same report).
    """
    from polytrain.launchers.worker import WORKER_STATE

    spec, session = WORKER_STATE[_SPEC]
    session.next_index = start_index
    session.checkpoint = Checkpoint(checkpoint_url) if checkpoint_url else None
    session.components = None
    session.preemption = None  # a new group runs off the nodes that drained under the old one
    session.stopped_at = None
    session.collective_seq = 0
    session.uploader = None
    train_session.start(session)
    try:
        options = getattr(spec, "options", None) or {}
        loop_context = options.get("train_func_context") or contextlib.nullcontext
        with (
            session.strategy.worker_scope(session.worker_context),
            _library_env(spec, session),
            _working_dir(options.get("working_dir")),
            _env_vars(options.get("env_vars") or {}),
            loop_context(),
        ):
            if spec.takes_config:
                value = spec.fn(dict(spec.config))
            else:
                value = spec.fn()
            train_session.flush(session)  # the last ASYNC reports are part of the loop
            if session.context.world_rank == 0 and value is not None:
                train_session._ask_board(session, "set_return_value", value)
    except LoopPreempted:
        pass  # report() ended the loop: where is in the session
    except Exception as exc:
        if not session.worker_context.local_mode:
            raise  # the worker group turns it into a WorkerError with the remote traceback
        # Local mode: the same error a worker's would be, so fit() raises the same kinds.
        text = "".join(traceback.format_exception(exc))
        raise worker_error_like(
            exc, f"Worker rank 0 raised {type(exc).__name__}: {exc}\n\n{text}", 0, text
        ) from exc
    finally:
        try:
            if session.uploader is not None:
                session.uploader.close()
        finally:
            for undo in session.options.pop("on_loop_end", []):
                undo()  # what the loop's helpers changed in this process
            train_session.end()
    # Also when the loop swallowed the stop and returned: the group moves on either way.
    return LoopStopped(session.stopped_at) if session.stopped_at is not None else None


@contextlib.contextmanager
def _working_dir(path: str | None) -> Any:
    """Run the loop in the run's working directory when the trainer asks (``RAY_CHDIR_TO_TRIAL_DIR``)."""
    if not path:
        yield
        return
    os.makedirs(path, exist_ok=True)
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def _env_vars(variables: dict[str, str]) -> Any:
    """``RunConfig(worker_runtime_env={"env_vars": ...})`` for the loop's run (restored after: local mode)."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
