"""What the function API runs inside every worker: set up the session, run the user's loop."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from polytrain.backends.core.backend import Backend
from polytrain.backends.core.context import WorkerContext
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
        ),
    )


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
    train_session.start(session)
    try:
        with session.strategy.worker_scope(session.worker_context), _library_env(spec, session):
            if spec.takes_config:
                spec.fn(dict(spec.config))
            else:
                spec.fn()
    except LoopPreempted:
        pass  # report() ended the loop: where is in the session
    finally:
        train_session.end()
    # Also when the loop swallowed the stop and returned: the group moves on either way.
    return LoopStopped(session.stopped_at) if session.stopped_at is not None else None
