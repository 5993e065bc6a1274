"""classify_failure: which worker a failed group call blames, and as what."""

from __future__ import annotations

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from polytrain.errors import WorkerDiedError, WorkerError, WorkerHangError
from polytrain.launchers.placement import classify_failure
from polytrain.launchers.ranks import WorkerMetadata
from polytrain.runs.policies.failure import FailurePolicy

METADATA = [
    WorkerMetadata("n0", "10.0.0.1", "h0", 100),
    WorkerMetadata("n1", "10.0.0.2", "h1", 101),
]


class CollectiveAborted(RuntimeError):
    """Stands in for TensorFlow's DeadlineExceededError raised by a collective."""


def _task_error(rank_cause: BaseException) -> RayTaskError:
    return RayTaskError("train", "Traceback: ...", rank_cause)


class Probes:
    """ping_all stand-in: one list of answers per call, counted."""

    def __init__(self, *rounds: list) -> None:
        self.rounds = list(rounds)
        self.calls = 0

    def __call__(self) -> list:
        answers = self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1
        return answers


def test_a_user_error_with_every_peer_answering_stays_the_user_error():
    probes = Probes(["pong", "pong"])
    error = classify_failure(_task_error(ValueError("bad shape")), 0, METADATA, probes)
    assert isinstance(error, ValueError) and isinstance(error, WorkerError)
    assert not isinstance(error, FailurePolicy.retryable)
    assert error.rank == 0 and probes.calls == 1


def test_a_dead_peer_is_blamed_as_a_lost_worker():
    probes = Probes(["pong", RayActorError()])
    error = classify_failure(_task_error(CollectiveAborted("peer gone")), 0, METADATA, probes)
    assert isinstance(error, WorkerDiedError) and error.rank == 1
    assert "rank 0 then failed with" in str(error)


def test_a_peer_silent_to_two_probes_is_blamed_as_a_hung_worker():
    silent = ["pong", GetTimeoutError("no reply")]
    probes = Probes(silent, silent)
    error = classify_failure(_task_error(CollectiveAborted("deadline")), 0, METADATA, probes)
    assert isinstance(error, WorkerHangError) and isinstance(error, FailurePolicy.retryable)
    assert error.rank == 1 and probes.calls == 2
    assert "pid 101 on 10.0.0.2" in str(error) and "stopped or frozen" in str(error)
    assert "CollectiveAborted: deadline" in str(error)


def test_a_peer_that_answers_the_second_probe_was_only_slow():
    probes = Probes(["pong", GetTimeoutError("slow")], ["pong", "pong"])
    error = classify_failure(_task_error(CollectiveAborted("deadline")), 0, METADATA, probes)
    assert isinstance(error, CollectiveAborted) and not isinstance(error, WorkerHangError)
    assert error.rank == 0 and probes.calls == 2


def test_the_failing_rank_itself_is_never_blamed_as_silent():
    # The failed rank's own probe may time out while its process exits: not a hang.
    probes = Probes([GetTimeoutError("exiting"), "pong"])
    error = classify_failure(_task_error(ValueError("bad")), 0, METADATA, probes)
    assert isinstance(error, ValueError) and probes.calls == 1
