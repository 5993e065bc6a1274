"""Inside the loop: ``report``, ``get_checkpoint``, ``get_context``, ``get_dataset_shard``, ``get_preemption_info``.

A worker running ``train_loop_per_worker`` holds one :class:`Session` (in its
``WORKER_STATE``) while the loop runs; outside a loop these functions raise,
naming what to do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from polytrain.backends.core.context import WorkerContext
from polytrain.checkpoint import layout
from polytrain.checkpoint.storage import Storage
from polytrain.errors import ConfigTypeError, PolytrainError
from polytrain.launchers.worker import WORKER_STATE, report_progress
from polytrain.train.checkpoint import Checkpoint, upload
from polytrain.train.preemption import LoopPreempted, PreemptionInfo

_KEY = "polytrain_train_session"


class SessionMisuseError(PolytrainError, RuntimeError):
    """A ``polytrain.train`` function called where it cannot work (outside a training loop)."""


@dataclass
class TrainContext:
    """Where this worker runs (Ray Train's ``TrainContext``)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    trial_name: str | None = None
    storage_path: str = ""

    def get_world_rank(self) -> int:
        """This worker's rank among all workers."""
        return self.world_rank

    def get_world_size(self) -> int:
        """The number of workers."""
        return self.world_size

    def get_local_rank(self) -> int:
        """This worker's rank among the workers of its node."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """The number of workers on this worker's node."""
        return self.local_world_size

    def get_node_rank(self) -> int:
        """The rank of this worker's node."""
        return self.node_rank

    def get_experiment_name(self) -> str:
        """The run's name (``RunConfig.name``)."""
        return self.experiment_name

    def get_trial_name(self) -> str | None:
        """The Tune trial's name, or None outside Tune."""
        return self.trial_name

    def get_storage(self) -> str:
        """The run's directory (local path or URL)."""
        return self.storage_path


@dataclass
class Session:
    """One worker's view of the running loop."""

    context: TrainContext
    worker_context: WorkerContext
    board: Any  # a ReportBoard, or a Ray actor handle of one
    run_url: str
    next_index: int = 0
    checkpoint: Checkpoint | None = None
    dataset_shards: dict[str, Any] = field(default_factory=dict)
    strategy: Any = None  # the backend's worker-side strategy (polytrain.train.torch)
    backend: Any = None  # the backend that made it (prepare_model(parallelism=...) remakes it)
    loader_split: Any = None  # (replicas, rank) prepare_data_loader split the data by
    components: Any = None  # what prepare() wrapped, for backward / step / no_sync
    preemption: PreemptionInfo | None = None  # the drain the last report() brought back
    stopped_at: int | None = None  # the report a drain ended the loop at (it must stay ended)


def start(session: Session) -> None:
    """Worker: make ``session`` the current one."""
    WORKER_STATE[_KEY] = session


def end() -> None:
    """Worker: leave the loop; the functions raise again."""
    WORKER_STATE.pop(_KEY, None)


def current(caller: str) -> Session:
    """The running loop's session.

    Raises:
        SessionMisuseError: no loop runs in this process.
    """
    session = WORKER_STATE.get(_KEY)
    if session is None:
        raise SessionMisuseError(
            f"polytrain.train.{caller}() was called outside a training loop. Call it inside "
            f"the train_loop_per_worker function that TorchTrainer(train_loop_per_worker=...)"
            f".fit() runs on every worker."
        )
    return session


def _check_metrics(metrics: Any) -> dict[str, Any]:
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise ConfigTypeError(
            f"report(metrics) takes a dict of metric names (str) to values; got "
            f"{type(metrics).__name__}: {metrics!r}."
        )
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()  # torch / numpy scalars: plain numbers for the dataframe
        out[key] = value
    return out


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Report this step's metrics, and optionally a checkpoint, from every worker.

    Every worker must call ``report`` the same number of times (as in Ray Train).
    Rank 0's metrics are kept (``Result.metrics``, ``metrics_dataframe``). Each rank
    that passes a checkpoint copies its directory's files into the run's
    ``checkpoint_NNNNNN`` directory (ranks may add their own files, e.g. shards);
    the directory is committed once every rank has reported the step.

    While a node of the group drains (the report answers with it: see
    :func:`get_preemption_info`), the first report with a checkpoint ends the loop on
    every rank once all have reported it: it does not return, and the run continues
    off the node from that checkpoint.

    Args:
        metrics: metric names to values (numbers, or anything JSON-able).
        checkpoint: a :class:`Checkpoint` from :meth:`Checkpoint.from_directory`.

    Raises:
        SessionMisuseError: called outside a training loop.
        ConfigTypeError: metrics not a dict, or checkpoint not a :class:`Checkpoint`.
    """
    session = current("report")
    if session.stopped_at is not None:  # the loop swallowed the stop: it is still over
        raise LoopPreempted(session.stopped_at)
    metrics = _check_metrics(metrics)
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise ConfigTypeError(
            f"report(checkpoint=...) takes a polytrain.train.Checkpoint (e.g. "
            f"Checkpoint.from_directory(path)); got {type(checkpoint).__name__}: {checkpoint!r}."
        )
    _check_accelerator()
    index = session.next_index
    session.next_index += 1
    if checkpoint is not None:
        upload(checkpoint, Storage(session.run_url).child(layout.checkpoint_name(index)))
    rank = session.context.world_rank
    # Returns when the board has the report: a commit never waits on us.
    info, done = _ask_board(
        session, "report", index, rank, metrics if rank == 0 else None, checkpoint is not None
    )
    # The hang watchdog and progress monitors see the loop move (metrics stay out of it:
    # a metric named like a progress field would clash).
    report_progress(index + 1, phase="train", reports=index + 1)
    session.preemption = info
    if info is not None and _committed(session, index, done):
        session.stopped_at = index
        raise LoopPreempted(index)  # every rank stops here; the driver moves the group


def _check_accelerator() -> None:
    """An ``Accelerator`` made in the loop must train as the backend does (cheap once checked)."""
    from polytrain.train.huggingface.accelerate_scope import check_accelerator

    check_accelerator()


#: Seconds between two looks at an announced step, doubling up to the second value.
_STEP_WAIT_S = (0.002, 0.05)


def _ask_board(session: Session, method: str, *args: Any) -> Any:
    call = getattr(getattr(session.board, method), "remote", None)
    if call is None:
        return getattr(session.board, method)(*args)  # local mode: the board is a plain object
    import ray

    return ray.get(call(*args))


def _committed(session: Session, index: int, done: bool | None) -> bool:
    """Whether step ``index`` committed a checkpoint; waits until every rank has reported it.

    Only after a drain was announced: whether this is the step every rank stops at
    depends on the other ranks' reports (rank 0 alone may pass the checkpoint).
    """
    wait = _STEP_WAIT_S[0]
    while done is None:
        time.sleep(wait)
        wait = min(2 * wait, _STEP_WAIT_S[1])
        done = _ask_board(session, "step_done", index)
    return done


def get_preemption_info() -> PreemptionInfo | None:
    """Whether a node of this run's worker group is draining: a :class:`PreemptionInfo`, or None.

    Ray Train's ``get_preemption_info()``. The answer is the one the loop's last
    :func:`report` call brought back from the driver (None before the first report),
    and it is the same on every rank at the same ``report()`` call: the driver
    announces a drain from a report no rank has made yet. So a loop that reads it
    after each ``report()`` decides alike on every rank, and calling it costs nothing
    (no round trip, no barrier).

    What to do with it: report a checkpoint. Of the reports that answer with the
    drain, the first that carries a checkpoint is this group's last: once every rank
    has reported that step, ``report()`` does not return; the loop ends there on every
    rank, and the run goes on in a new group off the draining node, where
    :func:`get_checkpoint` returns that checkpoint (counted in
    ``FailureConfig.max_preemption_failures``, not in ``max_failures``). A loop that
    reports no checkpoint before the node goes is restarted from its latest
    checkpoint as after any lost worker (counted in ``max_failures``). A loop that
    returns is done. Example::

        for step in range(start, steps):
            loss = train_step(step)
            if train.get_preemption_info() is not None:   # the node goes: save now
                with tempfile.TemporaryDirectory() as d:
                    save(model, optimizer, step, d)
                    train.report({"loss": loss}, checkpoint=train.Checkpoint.from_directory(d))
            else:
                train.report({"loss": loss})

    Returns:
        :class:`PreemptionInfo` (the node's id and IP, ``reason``, ``deadline_ms`` /
        ``deadline`` / ``seconds_left()``, the ``ranks`` on it), or None while no node of
        the group is draining (and always in local mode).

    Raises:
        SessionMisuseError: called outside a training loop.
    """
    return current("get_preemption_info").preemption


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint of this run (after a restart or for a resumed run), or None."""
    return current("get_checkpoint").checkpoint


def get_context() -> TrainContext:
    """This worker's ranks and the run's names."""
    return current("get_context").context


def get_dataset_shard(name: str | None = None) -> Any:
    """This worker's split of the Ray Data set passed as ``datasets={name: ds}``.

    Returns a ``DataIterator`` (``iter_torch_batches``, ``iter_batches``).

    Raises:
        KeyError: no data set of that name was passed to the trainer.
    """
    shards = current("get_dataset_shard").dataset_shards
    if name is None and len(shards) == 1:
        name = next(iter(shards))
    if name not in shards:
        raise KeyError(
            f"get_dataset_shard({name!r}): the trainer got no data set of that name; it got "
            f"{sorted(shards) or 'none'}. Pass datasets={{{name!r}: ray.data.Dataset}} to the trainer."
        )
    return shards[name]
