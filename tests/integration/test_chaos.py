"""The chaos run, short (issue 28, item 4): every fault kind once, over two torch backends.

``python benchmarks/run.py chaos`` (:mod:`benchmarks.chaos.suite`) builds a simulated
multi-node cluster (``ray.cluster_utils.Cluster``: a CPU-less head, 2-CPU worker nodes on
loopback addresses) in a fresh process, trains an uninterrupted reference run and a run
under a seeded fault schedule, each through driver processes that resume (``resume=True``),
and writes its findings as JSON. Here: ddp under a worker SIGKILL, a worker frozen by
SIGSTOP (caught by the hang watchdog) and a driver SIGTERM; fsdp under a node removal and
node drains with and without a deadline; TFTrainer under a frozen worker with a watchdog
slower than TensorFlow's coordination service (which fails the live peer with
``DeadlineExceededError`` first: that must still be taken for a lost worker). Each must end
with the reference's weights bit for bit, lose no step to an announced fault and at most
``every_n_steps`` (an epoch for TFTrainer) to the others, and leave no actor, placement
group, worker process or stray checkpoint file behind. ``make chaos`` runs the whole thing
(20 faults per backend, every torch backend and TFTrainer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"
EVERY_N_STEPS = 4
RUNS = {
    "ddp": ("kill_worker", "hang_worker", "driver_sigterm"),
    "fsdp": ("remove_node", "drain_deadline", "drain_no_deadline"),
    "mwms": ("hang_worker",),
}
#: The watchdog's timeout per run: 30 s for TFTrainer, above the ~13 s after which
#: TensorFlow aborts the frozen worker's peer.
HANG_TIMEOUT_S = {"ddp": 4, "fsdp": 4, "mwms": 30}
ANNOUNCED = {"drain_deadline", "drain_no_deadline", "driver_sigterm"}


@pytest.fixture(scope="module", params=sorted(RUNS))
def chaos(request, tmp_path_factory) -> dict:
    """One short chaos run of a backend, its JSON record."""
    backend, kinds = request.param, RUNS[request.param]
    out = tmp_path_factory.mktemp(f"chaos-{backend}")
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")
    }
    env["PYTHONPATH"] = str(REPO)  # this repository's benchmarks package, not fairscale's
    command = [
        sys.executable, str(RUN), "chaos", "--backends", backend, "--faults", str(len(kinds)),
        "--kinds", ",".join(kinds), "--seed", "0", "--out", str(out), "--gap", "8",
        "--tail", "30", "--every-n-steps", str(EVERY_N_STEPS), "--hang-timeout-s", str(HANG_TIMEOUT_S[backend]),
        "--drain-deadline-s", "8",
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=570)
    path = out / "chaos.json"
    assert path.exists(), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (result,) = json.loads(path.read_text())
    result["_output"] = proc.stdout[-3000:] + proc.stderr[-3000:]
    return result


def test_every_fault_is_survived_with_the_uninterrupted_weights(chaos):
    assert "error" not in chaos, chaos.get("error")
    assert chaos["chaos"]["error"] is None, chaos["_output"]
    faults = chaos["chaos"]["faults"]
    assert [f["kind"] for f in faults if f["injected"]] == [f["kind"] for f in chaos["schedule"]]
    assert sorted(f["kind"] for f in faults) == sorted(RUNS[chaos["case"]])
    # exactly: the group keeps its size, ranks keep their shards, random states are restored
    assert chaos["weights"]["bit_equal"], chaos["weights"]
    log = chaos["chaos"]["log"]
    assert log["missing_steps"] == [] and log["last_step"] == chaos["total_steps"]
    for fault in faults:  # each one took effect: the group went on in new processes
        assert "no_restart_seen" not in fault and fault["restarted_after_s"] > 0, fault


def test_steps_lost_per_fault_are_as_designed(chaos):
    # TFTrainer checkpoints at epoch ends only: an unannounced fault costs up to an epoch.
    unannounced = (
        EVERY_N_STEPS if chaos["framework"] == "torch" else chaos["total_steps"] // chaos["epochs"]
    )
    for fault in chaos["chaos"]["faults"]:
        designed = 0 if fault["kind"] in ANNOUNCED else unannounced
        assert fault["designed_max"] == designed
        assert fault["steps_lost"] <= designed, fault
    # the driver SIGTERM was a real one: a second driver process resumed the run
    if "driver_sigterm" in RUNS[chaos["case"]]:
        codes = [s["returncode"] for s in chaos["chaos"]["segments"]]
        assert codes == [143, 0], chaos["chaos"]["segments"]
        assert chaos["chaos"]["segments"][1]["start"] != [0, 0]


def test_the_frozen_worker_is_caught_and_gone(chaos):
    hangs = [f for f in chaos["chaos"]["faults"] if f["kind"] == "hang_worker"]
    if not hangs:
        pytest.skip(f"{chaos['case']} has no hang in its schedule")
    for fault in hangs:
        assert "stopped_process_left" not in fault, fault
        assert "stopped_process_gone_s" in fault, fault


def test_drains_move_off_the_node(chaos):
    drains = [f for f in chaos["chaos"]["faults"] if f["kind"].startswith("drain")]
    if not drains:
        pytest.skip(f"{chaos['case']} has no drain in its schedule")
    for fault in drains:
        assert fault["accepted"][0] is True, fault  # the GCS took the drain request
        assert fault["rollbacks"] == 0 and fault["steps_lost"] == 0, fault
    counted = sum(s.get("num_drains", 0) for s in chaos["chaos"]["segments"])
    assert counted == len(drains)


def test_nothing_is_left_behind(chaos):
    assert chaos["leftovers"] == {"actors": [], "placement_groups": []}
    assert chaos["processes_left"] == []
    assert chaos["stray_files"] == [] and chaos["reference"]["stray_files"] == []
    for segment in chaos["chaos"]["segments"]:
        assert segment["leftovers"] == {"actors": [], "placement_groups": []}, segment


def test_the_short_runs_cover_every_fault_kind():
    from benchmarks.chaos.schedule import KINDS

    assert {kind for kinds_of_run in RUNS.values() for kind in kinds_of_run} == set(KINDS)
