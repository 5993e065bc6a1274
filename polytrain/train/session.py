"""Inside the loop: ``report``, ``get_checkpoint``, ``get_context``, ``get_dataset_shard``, ``get_preemption_info``, ``get_all_reported_checkpoints``.

A worker running ``train_loop_per_worker`` holds one :class:`Session` (in its
``WORKER_STATE``) while the loop runs; outside a loop these functions raise,
naming what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polytrain.backends.core.context import WorkerContext
from polytrain.checkpoint import layout
from polytrain.errors import ConfigTypeError, PolytrainError
from polytrain.launchers.worker import WORKER_STATE, report_progress
from polytrain.train.checkpoint import Checkpoint, checkpoint_of, kind_of, pyarrow_filesystem
from polytrain.train.errors import DeprecatedOptionError
from polytrain.train.preemption import LoopPreempted, PreemptionInfo
from polytrain.train.reporting import (
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
)
from polytrain.train.uploads import Uploader, check_dir_name, check_mode
from polytrain.train.validation import check_request, spec_for_board

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
        """The Tune trial's name, or None outside Tune (Ray Train 2.x refuses the call)."""
        return self.trial_name

    def get_storage(self) -> RunStorage:
        """The run's directory (local path or URL): a ``str`` with Ray Train's ``StorageContext`` fields."""
        return RunStorage(self.storage_path, self.experiment_name)

    def get_metadata(self) -> dict[str, Any]:
        """Removed in Ray Train 2.x; raises :class:`~polytrain.train.errors.DeprecatedOptionError`."""
        raise DeprecatedOptionError(
            "TrainContext.get_metadata() is removed (as in Ray Train 2.x): pass what the loop "
            "needs in train_loop_config."
        )

    def get_trial_id(self) -> str:
        """Ray Tune's; raises :class:`~polytrain.train.errors.DeprecatedOptionError` (use ``ray.tune.get_context()``)."""
        raise DeprecatedOptionError(_TUNE_ONLY.format("get_trial_id"))

    def get_trial_resources(self) -> Any:
        """Ray Tune's; raises :class:`~polytrain.train.errors.DeprecatedOptionError` (use ``ray.tune.get_context()``)."""
        raise DeprecatedOptionError(_TUNE_ONLY.format("get_trial_resources"))

    def get_trial_dir(self) -> str:
        """Ray Tune's; raises :class:`~polytrain.train.errors.DeprecatedOptionError` (use ``get_storage()``)."""
        raise DeprecatedOptionError(_TUNE_ONLY.format("get_trial_dir"))


_TUNE_ONLY = (
    "TrainContext.{}() is a Ray Tune call, removed from Ray Train 2.x: inside a Tune trial use "
    "ray.tune.get_context(); the run's directory is get_context().get_storage()."
)


class RunStorage(str):
    """The run's directory as a ``str``, with Ray Train's ``StorageContext`` attribute names.

    Attributes:
        experiment_fs_path: the run's directory (the string itself).
        storage_path: the directory runs are stored in.
        experiment_dir_name: the run's name.
        storage_filesystem: its ``pyarrow.fs.FileSystem``.
    """

    def __new__(cls, path: str, name: str) -> RunStorage:  # noqa: D102
        value = super().__new__(cls, path)
        value.experiment_fs_path = path
        value.storage_path = path.rstrip("/").rsplit("/", 1)[0]
        value.experiment_dir_name = name
        return value

    @property
    def storage_filesystem(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` of the run's directory."""
        return pyarrow_filesystem(self.experiment_fs_path)

    def build_checkpoint_path_from_name(self, name: str) -> str:
        """The location of the run's checkpoint directory ``name``."""
        return f"{self.experiment_fs_path.rstrip('/')}/{name}"


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
    options: dict[str, Any] = field(default_factory=dict)  # the trainer's Ray Train options
    collective_seq: int = 0  # the next collective's number (polytrain.train.collective)
    uploader: Uploader | None = None  # this attempt's checkpoint uploads, in report order


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
    return {key: _plain(key, value) for key, value in metrics.items()}


def _plain(key: str, value: Any) -> Any:
    """Scalars of torch / numpy as numbers; a larger tensor is refused (as Ray Train does)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()  # torch / numpy scalars: plain numbers for the dataframe
    if type(value).__module__.startswith("torch") and hasattr(value, "shape"):
        raise ConfigTypeError(
            f"report(metrics): {key!r} is a torch tensor of shape {tuple(value.shape)}; metrics "
            f"must be plain values. Convert it (.item(), .tolist()) or save tensors in the "
            f"checkpoint's files."
        )
    if isinstance(value, dict):
        return {k: _plain(f"{key}/{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(key, v) for v in value)
    return value


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None,
    validation: Any = False,
) -> None:
    """Report this step's metrics, and optionally a checkpoint, from every worker (Ray Train's).

    Every worker must call ``report`` the same number of times. Rank 0's metrics are
    kept (``Result.metrics``); callbacks get every rank's. Each rank that passes a
    checkpoint copies its files into the step's directory of the run (ranks may add
    their own files, e.g. shards), committed once every rank has reported the step.
    While a node of the group drains (see :func:`get_preemption_info`), the first
    report with a checkpoint ends the loop on every rank: it does not return, and
    the run continues off the node from that checkpoint.

    Args:
        metrics: metric names to values (numbers or JSON-able; no tensors but scalars).
        checkpoint: a :class:`Checkpoint` from :meth:`Checkpoint.from_directory`.
        checkpoint_dir_name: the checkpoint's folder in the run (the same on every rank
            that passes a checkpoint); None: ``checkpoint_NNNNNN``, the report's number.
        checkpoint_upload_mode: ``SYNC``, ``ASYNC`` (a background thread) or
            ``NO_UPLOAD`` (already in the run's directory):
            :class:`~polytrain.train.CheckpointUploadMode`.
        delete_local_checkpoint_after_upload: delete the source after the copy (None:
            for ``ASYNC`` only).
        checkpoint_upload_fn: ``fn(checkpoint, dir_name) -> Checkpoint`` doing the copy.
        validation: True or a :class:`~polytrain.train.ValidationTaskConfig`: validate
            the checkpoint with the trainer's ``validation_config`` once committed.

    Raises:
        SessionMisuseError: outside a loop. ConfigError: a wrong argument (it says which).
    """
    session = current("report")
    if session.stopped_at is not None:  # the loop swallowed the stop: it is still over
        raise LoopPreempted(session.stopped_at)
    metrics = _check_metrics(metrics)
    upload = _plan(session, checkpoint, checkpoint_dir_name, checkpoint_upload_mode)
    _check_accelerator()
    upload.delete_after = _delete_after(upload.mode, delete_local_checkpoint_after_upload)
    upload.fn = checkpoint_upload_fn
    spec = check_request(validation, checkpoint is not None, session.options.get("has_validation"))
    if checkpoint is not None:
        _uploader(session).check_source(checkpoint, upload.mode, upload.delete_after)
    index = session.next_index
    session.next_index += 1
    upload.name = upload.name or layout.checkpoint_name(index)
    background = upload.mode == CheckpointUploadMode.ASYNC and checkpoint is not None
    answer = _uploader(session).submit(
        lambda: _deliver(session, index, metrics, upload, spec), background
    )
    if background:
        return  # a drain it brings back stops the loop at a later report
    info, done = answer
    if info is not None and _committed(session, index, done):
        session.stopped_at = index
        raise LoopPreempted(index)  # every rank stops here; the driver moves the group


@dataclass
class _Upload:
    """How one report's checkpoint is stored."""

    checkpoint: Checkpoint | None
    name: str | None
    mode: CheckpointUploadMode
    delete_after: bool
    fn: Callable[[Checkpoint, str], Checkpoint] | None = None


def _plan(session: Session, checkpoint: Any, dir_name: Any, mode: Any) -> _Upload:
    """``report``'s checkpoint arguments, checked: how to store it."""
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise ConfigTypeError(
            f"report(checkpoint=...) takes a polytrain.train.Checkpoint (e.g. "
            f"Checkpoint.from_directory(path)); got {type(checkpoint).__name__}: {checkpoint!r}."
        )
    return _Upload(checkpoint, check_dir_name(dir_name), check_mode(mode), False)


def _delete_after(mode: CheckpointUploadMode, asked: bool | None) -> bool:
    return mode.default_delete_local_checkpoint_after_upload() if asked is None else bool(asked)


def _deliver(
    session: Session, index: int, metrics: dict[str, Any], upload: _Upload, spec: Any
) -> tuple[PreemptionInfo | None, bool | None]:
    """Store the checkpoint, then tell the board (in the caller, or the upload thread)."""
    name = None
    if upload.checkpoint is not None:
        name = session.uploader.store(
            upload.checkpoint, upload.name, index, upload.mode, upload.delete_after, upload.fn
        )
    # Returns when the board has the report: a commit never waits on us.
    answer = _ask_board(
        session,
        "report",
        index,
        session.context.world_rank,
        metrics,
        upload.checkpoint is not None,
        name,
        spec_for_board(spec),
        kind_of(upload.checkpoint) if upload.checkpoint is not None else None,
    )
    # The hang watchdog and progress monitors see the loop move (metrics stay out of it:
    # a metric named like a progress field would clash).
    report_progress(index + 1, phase="train", reports=index + 1)
    session.preemption = answer[0]
    return answer


def _uploader(session: Session) -> Uploader:
    if session.uploader is None:
        session.uploader = Uploader(session.run_url)
    return session.uploader


def flush(session: Session) -> None:
    """Worker: wait for this worker's background reports (raising an upload's error)."""
    if session.uploader is not None:
        session.uploader.flush()


def collective(session: Session, payload: Any) -> Any:
    """Worker: meet every rank at the next collective; returns rank 0's ``payload``."""
    flush(session)
    seq = session.collective_seq
    session.collective_seq += 1
    rank = session.context.world_rank
    ready, value = _ask_board(session, "collective", seq, rank, payload)
    wait = _STEP_WAIT_S[0]
    while not ready:
        time.sleep(wait)
        wait = min(2 * wait, _STEP_WAIT_S[1])
        ready, value = _ask_board(session, "collective_result", seq, rank)
    return value


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
    timeout_s: float | None = None,
) -> list[ReportedCheckpoint]:
    """Every checkpoint the run keeps so far, with its metrics and status (Ray Train's).

    Waits until every rank has made the reports this worker made so far (and, with
    ``VALIDATED``, until their validations have finished). The list is in Ray Train's
    order: by ``checkpoint_score_attribute``, worst first, or by report order.

    Args:
        consistency_mode: what to wait for (:class:`~polytrain.train.CheckpointConsistencyMode`).
        timeout_s: wait at most this long, then answer with what is there. None: no limit.

    Raises:
        SessionMisuseError: called outside a training loop.
    """
    session = current("get_all_reported_checkpoints")
    if not isinstance(consistency_mode, CheckpointConsistencyMode):
        raise ConfigTypeError(
            f"get_all_reported_checkpoints(consistency_mode={consistency_mode!r}) must be a "
            f"CheckpointConsistencyMode: {[m.name for m in CheckpointConsistencyMode]}."
        )
    flush(session)
    validated = consistency_mode == CheckpointConsistencyMode.VALIDATED
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    wait = _STEP_WAIT_S[0]
    upto = session.next_index - 1
    while True:
        found = _ask_board(session, "reported_checkpoints", upto, validated)
        if found is not None:
            break
        if deadline is not None and time.monotonic() >= deadline:
            found = _ask_board(session, "reported_checkpoints", -1, False) or []
            break
        time.sleep(wait)
        wait = min(2 * wait, _STEP_WAIT_S[1])
    return [
        ReportedCheckpoint(checkpoint_of(url, kind), metrics, ReportedCheckpointStatus[status])
        for url, metrics, status, kind in found
    ]


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

    Returns a ``DataIterator`` (``iter_torch_batches``, ``iter_batches``), or None when
    the trainer got no datasets and no name is asked for (as Ray Train).

    Raises:
        KeyError: no data set of that name was passed to the trainer.
    """
    shards = current("get_dataset_shard").dataset_shards
    if name is None and not shards:
        return None  # Ray Train's answer when the trainer got no datasets
    if name is None and len(shards) == 1:
        name = next(iter(shards))
    if name not in shards:
        raise KeyError(
            f"get_dataset_shard({name!r}): the trainer got no data set of that name; it got "
            f"{sorted(shards) or 'none'}. Pass datasets={{{name!r}: ray.data.Dataset}} to the trainer."
        )
    return shards[name]
