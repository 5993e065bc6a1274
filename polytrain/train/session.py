"""Inside the loop: ``report``, ``get_checkpoint``, ``get_context``, ``get_dataset_shard``.

A worker running ``train_loop_per_worker`` holds one :class:`Session` (in its
``WORKER_STATE``) while the loop runs; outside a loop these functions raise,
naming what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytrain.backends.core.context import WorkerContext
from polytrain.checkpoint import layout
from polytrain.checkpoint.storage import Storage
from polytrain.errors import ConfigTypeError, PolytrainError
from polytrain.launchers.worker import WORKER_STATE, report_progress
from polytrain.train.checkpoint import Checkpoint, upload

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
    components: Any = None  # what prepare() wrapped, for backward / step / no_sync


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

    Args:
        metrics: metric names to values (numbers, or anything JSON-able).
        checkpoint: a :class:`Checkpoint` from :meth:`Checkpoint.from_directory`.

    Raises:
        SessionMisuseError: called outside a training loop.
        ConfigTypeError: metrics not a dict, or checkpoint not a :class:`Checkpoint`.
    """
    session = current("report")
    metrics = _check_metrics(metrics)
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise ConfigTypeError(
            f"report(checkpoint=...) takes a polytrain.train.Checkpoint (e.g. "
            f"Checkpoint.from_directory(path)); got {type(checkpoint).__name__}: {checkpoint!r}."
        )
    index = session.next_index
    session.next_index += 1
    if checkpoint is not None:
        upload(checkpoint, Storage(session.run_url).child(layout.checkpoint_name(index)))
    rank = session.context.world_rank
    call = getattr(session.board.report, "remote", None)
    args = (index, rank, metrics if rank == 0 else None, checkpoint is not None)
    if call is not None:
        import ray

        ray.get(call(*args))  # returns when the board has the report: a commit never waits on us
    else:
        session.board.report(*args)
    # The hang watchdog and progress monitors see the loop move (metrics stay out of it:
    # a metric named like a progress field would clash).
    report_progress(index + 1, phase="train", reports=index + 1)


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
