"""The chaos run (issue 28, item 4): a seeded fault schedule over a long training run.

Per backend, on a simulated multi-node cluster (``ray.cluster_utils.Cluster``: a
CPU-less head on 127.0.0.1 and 2-CPU worker nodes on 127.0.0.2, .3, ...; the
workers SPREAD one per worker node), the same training runs twice, each run a
sequence of driver processes (``benchmarks/chaos_driver.py``, ``resume=True``):

* the *reference*: no fault, start to end;
* the *chaos run*: a seeded schedule of ``(step, fault kind, target rank)`` is
  injected from outside while it trains:

  ============================  =============================================================
  ``kill_worker``               SIGKILL of the target rank's worker process
  ``hang_worker``               SIGSTOP of it: a frozen worker the hang watchdog must catch
  ``remove_node``               the node of the target rank goes away (raylet and workers
                                killed; graceful or not, seeded); a replacement node joins
  ``drain_deadline``            the node is drained (a preemption announced through the
                                GCS call of ``ray drain-node``) with a deadline; a replacement
                                joins at once, and at the deadline the node is killed if still up
  ``drain_no_deadline``         the same drain without a deadline
  ``driver_sigterm``            SIGTERM to the driver process: it checkpoints, exits 143, and
                                the next driver segment resumes
  ============================  =============================================================

Then: the final weights of both runs (bit for bit, or the largest difference), the
steps lost per fault against the designed bound (from the steps log rank 0 writes:
a step trained twice was lost once), the wall time lost per fault (the time of the
fault's window beyond what its new steps take at the reference run's pace), actors
and placement groups left alive in the cluster once the drivers are gone, worker
processes left running, and stray files in the checkpoint directory (anything but
committed checkpoints within ``num_to_keep``).

Usage::

    PYTHONPATH=. python benchmarks/chaos.py --backends ddp,mwms --faults 20 --seed 0 --out DIR
    PYTHONPATH=. python benchmarks/chaos.py --backends ddp --faults 3 \
        --kinds kill_worker,hang_worker,driver_sigterm --out DIR        # a short run

Writes ``DIR/chaos.json`` (everything) and ``DIR/chaos.md`` (the tables of
RELIABILITY.md); exits 0 when every backend passed every check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    # fairscale installs a top-level ``benchmarks`` package: this repository's must win.
    sys.path.insert(0, str(REPO))
# The raylets' workers import the workload as benchmarks.chaos_workload.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

from benchmarks.chaos_workload import STEPS_LOG, STEPS_PER_EPOCH  # noqa: E402

DRIVER = Path(__file__).with_name("chaos_driver.py")
KINDS = (
    "kill_worker",
    "hang_worker",
    "remove_node",
    "drain_deadline",
    "drain_no_deadline",
    "driver_sigterm",
)
ANNOUNCED = ("drain_deadline", "drain_no_deadline", "driver_sigterm")
NODE_KINDS = ("remove_node", "drain_deadline", "drain_no_deadline")
TORCH_CASES = ("ddp", "horovod", "fairscale", "fsdp", "deepspeed")
ALL_CASES = (*TORCH_CASES, "mwms")
NUM_WORKERS = 2
#: The largest final-weight difference accepted per case (0.0: bit for bit). Every case
#: is held to bit equality: the group keeps its size, its ranks keep their data shard
#: and random states, and the checkpoints hold the exact values.
WEIGHT_TOL: dict[str, float] = {}
#: A run with no new step for this long is stuck: its driver is killed and the run fails.
STALL_S = 240.0


# ------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Fault:
    """One scheduled fault: at global step ``step`` (1-based), ``kind`` hits rank ``rank`` (or its node)."""

    step: int
    kind: str
    rank: int
    graceful: bool = False  # remove_node: let the node's processes shut down first


def make_schedule(
    num_faults: int, seed: int, kinds: tuple[str, ...] = KINDS, first: int = 12, gap: int = 10
) -> list[Fault]:
    """A seeded schedule: the kinds in rounds (each round every kind once, shuffled), ``gap`` steps apart plus jitter."""
    rng = random.Random(seed)
    order: list[str] = []
    faults = []
    for i in range(num_faults):
        if not order:
            order = rng.sample(list(kinds), len(kinds))
        kind = order.pop()
        step = first + i * gap + rng.randrange(max(1, gap // 2))
        graceful = kind == "remove_node" and rng.random() < 0.5
        faults.append(Fault(step, kind, rng.randrange(NUM_WORKERS), graceful))
    return faults


def designed_loss(kind: str, framework: str, every_n_steps: int) -> int:
    """The most steps a fault of ``kind`` may cost by design.

    Torch trainers checkpoint every ``every_n_steps`` and leave a draining node at a
    step. TFTrainer's calls are whole epochs, checkpointed at their ends: a lost worker
    costs the epoch so far, and a draining node is left when the running epoch ends
    (nothing lost while the deadline is further away than that). Announced faults: 0.
    """
    if kind in ANNOUNCED:
        return 0
    return every_n_steps if framework == "torch" else STEPS_PER_EPOCH


def framework_of(case: str) -> str:
    """``tensorflow`` for the TFTrainer case, else ``torch``."""
    return "tensorflow" if case in ("mwms", "tensorflow", "tf") else "torch"


# ------------------------------------------------------------ the cluster
class SimCluster:
    """A ``ray.cluster_utils.Cluster``: a CPU-less head and two 2-CPU worker nodes at a time.

    Lost or drained nodes are replaced at once by a node on a fresh loopback address
    (as an autoscaler would), so the group can always restart at full size.
    """

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        from polytrain.launchers.cluster.connect import ensure_ray

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        self._next_ip = 2
        self.nodes: dict[str, Any] = {}  # node id -> ray._private.node.Node (worker nodes)
        for _ in range(NUM_WORKERS):
            self.add_node()
        self.cluster.wait_for_nodes()
        ensure_ray(self.cluster.address, timeout_s=60)
        self.address = self.cluster.address

    def add_node(self) -> str:
        """Start a 2-CPU worker node on the next loopback address; returns its node id."""
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        node = self.cluster.add_node(num_cpus=2, node_ip_address=ip)
        self.nodes[node.node_id] = node
        return node.node_id

    def remove(self, node_id: str, graceful: bool) -> None:
        """Kill a worker node's processes (raylet, workers)."""
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self.cluster.remove_node(node, allow_graceful=graceful)

    def drain(self, node_id: str, deadline_s: float | None) -> list[Any]:
        """Announce a preemption of the node as ``ray drain-node`` does; ``[accepted, reason]``."""
        import ray
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
        deadline_ms = (
            0 if deadline_s is None else time.time_ns() // 1_000_000 + int(deadline_s * 1000)
        )
        return list(
            gcs.drain_node(
                node_id,
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "polytrain chaos run",
                deadline_ms,
            )
        )

    @staticmethod
    def alive_nodes() -> set[str]:
        """Ids of the nodes the GCS sees alive."""
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    @staticmethod
    def leftovers(wait_s: float = 20.0) -> dict[str, list[str]]:
        """Actors not dead and placement groups not removed, in the whole cluster (after up to ``wait_s``)."""
        import ray
        from ray._private import state

        deadline = time.monotonic() + wait_s
        while True:
            actors = [
                f"{a['ActorClassName']} {a['ActorID'][:12]} {a['State']} pid {a.get('Pid')}"
                for a in state.actors().values()
                if a["State"] != "DEAD"
            ]
            groups = [
                f"{pg['placement_group_id'][:12]} {pg['state']}"
                for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"
            ]
            if (not actors and not groups) or time.monotonic() > deadline:
                return {"actors": actors, "placement_groups": groups}
            time.sleep(0.5)

    def shutdown(self) -> None:
        """Disconnect and stop every node this cluster started."""
        import ray

        ray.shutdown()
        self.cluster.shutdown()


# ---------------------------------------------------------------- one run
@dataclass
class Options:
    """How the runs train (shared by the reference and the chaos run)."""

    every_n_steps: int = 4
    step_sleep_s: float = 0.05
    hang_timeout_s: float = 8.0
    drain_deadline_s: float = 10.0
    driver_timeout_s: float = 900.0


@dataclass
class RunState:
    """What the orchestrator knows about a run while it trains."""

    run_dir: Path
    steps: list[tuple[float, int]] = field(default_factory=list)
    offset: int = 0
    pids: dict[int, dict[str, Any]] = field(default_factory=dict)  # every worker pid seen
    drained: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> drain facts
    stopped: list[dict[str, Any]] = field(default_factory=list)  # SIGSTOPped workers

    def read_steps(self) -> None:
        """Take the new lines of the steps log."""
        path = self.run_dir / "logs" / STEPS_LOG
        if not path.exists():
            return
        with open(path) as log:
            log.seek(self.offset)
            chunk = log.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            t, step = line.split()
            self.steps.append((float(t), int(step)))

    @property
    def max_step(self) -> int:
        """The furthest step trained so far."""
        return max((s for _, s in self.steps), default=0)

    def rank(self, rank: int) -> dict[str, Any] | None:
        """The newest ``rank_<r>.json`` (the process that holds the rank now, or held it last)."""
        path = self.run_dir / "logs" / f"rank_{rank}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        self.pids.setdefault(record["pid"], record)
        return record


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, T (stopped), Z (zombie), ...) or None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def processes_left(pids: dict[int, Any], wait_s: float = 20.0) -> list[int]:
    """The worker processes of ``pids`` still running after up to ``wait_s`` (zombies count as gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(pid for pid in pids if process_state(pid) not in (None, "Z"))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


class ChaosRun:
    """One run of one case: driver segments, fault injection, the raw records."""

    def __init__(
        self,
        case: str,
        run_dir: Path,
        epochs: int,
        sim: SimCluster,
        options: Options,
        schedule: list[Fault],
    ) -> None:
        self.case, self.epochs, self.sim, self.options = case, epochs, sim, options
        self.framework = framework_of(case)
        self.schedule = list(schedule)
        self.state = RunState(run_dir)
        self.faults: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        self.error: str | None = None
        self._next_node_look = 0.0
        # The last fault's effect still to show: the group restarted (every rank a new process).
        self._awaiting: dict[str, Any] | None = None
        self._effect_t = 0.0
        run_dir.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------- drivers
    def _driver(self, segment: int) -> subprocess.Popen:
        hang = self.options.hang_timeout_s
        command = [
            sys.executable, str(DRIVER), "--address", self.sim.address, "--case", self.case,
            "--run-dir", str(self.state.run_dir), "--epochs", str(self.epochs),
            "--every-n-steps", str(self.options.every_n_steps), "--hang-timeout-s", str(hang),
            "--step-sleep-s", str(self.options.step_sleep_s), "--segment", str(segment),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(POLYTRAIN_WARM_POOL="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        out = open(self.state.run_dir / f"driver_{segment}.log", "w")  # noqa: SIM115 - the child's
        try:
            return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()

    def run(self) -> float:
        """Train to the end through as many driver segments as SIGTERMs ask; returns the wall time."""
        start = time.monotonic()
        pending = list(self.schedule)
        segment = 0
        while True:
            proc = self._driver(segment)
            sigterm = self._watch(proc, pending)
            record = self._segment_record(segment, proc.returncode)
            self.segments.append(record)
            if proc.returncode == 0 or self.error is not None:
                break
            if not (sigterm and proc.returncode in (143, -signal.SIGTERM)):
                self.error = f"driver segment {segment} exited with {proc.returncode}"
                break
            segment += 1
        self.state.read_steps()
        self._settle_drains(final=True)
        self._check_stopped(final=True)
        return time.monotonic() - start

    def _segment_record(self, segment: int, code: int | None) -> dict[str, Any]:
        path = self.state.run_dir / f"segment_{segment}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {"segment": segment, "error": "no segment record (the driver died)"}
        record["returncode"] = code
        return record

    def _watch(self, proc: subprocess.Popen, pending: list[Fault]) -> bool:
        """Inject the faults that fall due while this driver runs; True if it got a SIGTERM."""
        sigterm = False
        deadline = time.monotonic() + self.options.driver_timeout_s
        last_progress, last_max = time.monotonic(), -1
        next_look = 0.0
        while proc.poll() is None:
            self.state.read_steps()
            if time.monotonic() >= next_look:  # note every worker process, for the end's check
                for rank in range(NUM_WORKERS):
                    self.state.rank(rank)
                next_look = time.monotonic() + 0.5
            if self.state.max_step != last_max:
                last_progress, last_max = time.monotonic(), self.state.max_step
            self._settle_drains()
            self._check_stopped()
            self._check_effect()
            if pending and not sigterm and self._ready(pending[0]):
                fault = pending.pop(0)
                record = self._inject(fault, proc)
                self.faults.append(record)
                sigterm = fault.kind == "driver_sigterm" and record.get("injected", False)
            now = time.monotonic()
            if now - last_progress > STALL_S or now > deadline:
                self.error = (
                    f"no new step for {now - last_progress:.0f} s (at step {self.state.max_step})"
                    if now - last_progress > STALL_S
                    else f"the driver ran past {self.options.driver_timeout_s:.0f} s"
                )
                proc.kill()
                proc.wait()
                break
            time.sleep(0.02)
        return sigterm

    # ------------------------------------------------------------ faults
    def _ready(self, fault: Fault) -> bool:
        """The fault's step is reached, earlier faults are settled and its target is running."""
        if self.state.max_step < fault.step or self._awaiting is not None:
            return False
        if not self.state.steps or self.state.steps[-1][0] <= self._effect_t:
            return False  # the restarted group has not trained a step yet
        if self.state.steps[-1][1] < self.state.max_step:
            # Still training again the steps a rollback took back: they belong to the fault
            # before, and the next one waits until the run is past where it was.
            return False
        if any(d["deadline"] is not None and not d["settled"] for d in self.state.drained.values()):
            return False  # a drain's deadline is still to come: one fault at a time
        if self.state.stopped and not all(s.get("settled") for s in self.state.stopped):
            return False
        if fault.kind == "driver_sigterm":
            # Right after a step that does not end an epoch: the driver is inside train(),
            # where SIGTERM is acted on (between two calls it kills the process as before).
            t, step = self.state.steps[-1]
            return time.time() - t < 0.5 * self.options.step_sleep_s and bool(
                step % STEPS_PER_EPOCH
            )
        target = self._target(fault)
        return target is not None and process_state(target["pid"]) not in (None, "T", "Z")

    def _target(self, fault: Fault) -> dict[str, Any] | None:
        """The rank file of the fault's target (for a drain: a rank whose node is not draining yet)."""
        ranks = [fault.rank, 1 - fault.rank]
        for rank in ranks if fault.kind in ("drain_deadline", "drain_no_deadline") else ranks[:1]:
            record = self.state.rank(rank)
            if record is None or record["node_id"] not in self.sim.nodes:
                continue
            if fault.kind.startswith("drain") and record["node_id"] in self.state.drained:
                continue
            return record
        return None

    def _inject(self, fault: Fault, proc: subprocess.Popen) -> dict[str, Any]:
        record: dict[str, Any] = {
            **asdict(fault),
            "index": len(self.faults),
            "at_step": self.state.max_step,
            "t": time.time(),
            "injected": True,
        }
        group = [self.state.rank(rank) for rank in range(NUM_WORKERS)]
        pids = {r["pid"] for r in group if r is not None}
        self._awaiting = {"fault": record["index"], "pids": pids, "t": record["t"]}
        if fault.kind == "driver_sigterm":
            record["pid"] = proc.pid
            proc.send_signal(signal.SIGTERM)
            return record
        target = self._target(fault)
        if target is None:  # every node of the group is draining already (not left yet)
            record.update(injected=False, skipped="every node of the group is draining already")
            self._awaiting = None
            return record
        record.update(target_rank=target["rank"], pid=target["pid"], node_id=target["node_id"])
        if fault.kind == "kill_worker":
            os.kill(target["pid"], signal.SIGKILL)
        elif fault.kind == "hang_worker":
            os.kill(target["pid"], signal.SIGSTOP)
            self.state.stopped.append(
                {"pid": target["pid"], "t": time.time(), "fault": record["index"]}
            )
        elif fault.kind == "remove_node":
            self.sim.remove(target["node_id"], graceful=fault.graceful)
            self.sim.add_node()  # the replacement joins (an autoscaler's)
        else:
            deadline = self.options.drain_deadline_s if fault.kind == "drain_deadline" else None
            record["accepted"] = self.sim.drain(target["node_id"], deadline)
            self.sim.add_node()
            self.state.drained[target["node_id"]] = {
                "fault": record["index"],
                "deadline": None if deadline is None else time.time() + deadline,
                "settled": False,
            }
        record["t_done"] = time.time()
        return record

    def _check_effect(self) -> None:
        """Note when the last fault's effect shows: every rank held by a new process."""
        if self._awaiting is None:
            return
        now = time.time()
        fault = self.faults[self._awaiting["fault"]] if self.faults else None
        group = [self.state.rank(rank) for rank in range(NUM_WORKERS)]
        if all(r is not None and r["pid"] not in self._awaiting["pids"] for r in group):
            if fault is not None:
                fault["restarted_after_s"] = round(now - self._awaiting["t"], 2)
            self._awaiting, self._effect_t = None, now
        elif now - self._awaiting["t"] > STALL_S:
            if fault is not None:
                fault["no_restart_seen"] = True
            self._awaiting, self._effect_t = None, now

    def _settle_drains(self, final: bool = False) -> None:
        """Kill drained nodes at their deadline; clear those that left by themselves (idle)."""
        open_drains = [d for d in self.state.drained.values() if not d["settled"]]
        if not open_drains or (not final and time.monotonic() < self._next_node_look):
            return
        self._next_node_look = time.monotonic() + 0.5  # one GCS call per half second at most
        alive = self.sim.alive_nodes()
        for node_id, drain in self.state.drained.items():
            if drain["settled"]:
                continue
            fault = self.faults[drain["fault"]]
            if node_id not in alive:
                fault["node_left_s"] = round(time.time() - fault["t"], 2)  # idle: Ray shut it down
                self.sim.remove(node_id, graceful=True)
                drain["settled"] = True
            elif drain["deadline"] is not None and time.time() >= drain["deadline"]:
                fault["killed_at_deadline"] = True
                self.sim.remove(node_id, graceful=False)
                drain["settled"] = True
            elif final:
                self.sim.remove(node_id, graceful=True)
                drain["settled"] = True

    def _check_stopped(self, final: bool = False) -> None:
        """A SIGSTOPped worker must be gone once the group restarted; one left over is killed, and noted."""
        for stopped in self.state.stopped:
            if stopped.get("settled"):
                continue
            fault = self.faults[stopped["fault"]]
            state = process_state(stopped["pid"])
            if state is None or state == "Z":
                fault["stopped_process_gone_s"] = round(time.time() - stopped["t"], 2)
                stopped["settled"] = True
            elif final or time.time() - stopped["t"] > 120:
                fault["stopped_process_left"] = state
                os.kill(stopped["pid"], signal.SIGKILL)
                stopped["settled"] = True


# ---------------------------------------------------------------- analysis
def steps_lost(
    steps: list[tuple[float, int]], t0: float, t1: float, before: int
) -> tuple[int, int]:
    """``(steps trained again, rollbacks)`` among the log lines in ``[t0, t1)``.

    ``before``: the furthest step trained before ``t0``.
    """
    furthest, previous, lost, rollbacks = before, before, 0, 0
    for t, step in steps:
        if not t0 <= t < t1:
            continue
        lost += step <= furthest  # trained before: this is a second time
        rollbacks += step <= previous  # the log jumped back: a restart from a checkpoint
        furthest, previous = max(furthest, step), step
    return lost, rollbacks


def analyse(
    run: ChaosRun, reference_steps: list[tuple[float, int]], total_steps: int, every_n: int
) -> dict[str, Any]:
    """Steps and time lost per fault, and the checks on the steps log."""
    steps = run.state.steps
    ref_span = reference_steps[-1][0] - reference_steps[0][0] if len(reference_steps) > 1 else 0.0
    pace = ref_span / max(1, len(reference_steps) - 1)  # seconds per step, checkpoints included
    end = steps[-1][0] + 1e-6 if steps else time.time()
    injected = [f for f in run.faults if f.get("injected")]
    for i, fault in enumerate(injected):
        t0 = fault["t"]
        t1 = injected[i + 1]["t"] if i + 1 < len(injected) else end
        before = max((s for t, s in steps if t < t0), default=0)
        lost, rollbacks = steps_lost(steps, t0, t1, before)
        after = max((s for t, s in steps if t < t1), default=before)
        fault["steps_lost"] = lost
        fault["rollbacks"] = rollbacks
        fault["designed_max"] = designed_loss(fault["kind"], run.framework, every_n)
        fault["time_lost_s"] = round(max(0.0, (t1 - t0) - pace * max(0, after - before)), 2)
        fault["survived"] = run.error is None or i + 1 < len(injected)
    trained = [s for _, s in steps]
    first_fault = injected[0]["t"] if injected else end
    before_faults, _ = steps_lost(steps, 0.0, first_fault, 0)
    return {
        "pace_s_per_step": round(pace, 4),
        "steps_logged": len(trained),
        "steps_unique": len(set(trained)),
        "missing_steps": sorted(set(range(1, total_steps + 1)) - set(trained))[:20],
        "last_step": trained[-1] if trained else 0,
        "lost_before_first_fault": before_faults,
    }


def compare_weights(reference: Path, chaos: Path) -> dict[str, Any]:
    """The largest difference between the two runs' final models, and whether they are bit-equal."""
    import torch

    if not reference.exists() or not chaos.exists():
        return {"compared": False, "why": "a final state is missing"}
    a = torch.load(reference, weights_only=True)["models"][0]
    b = torch.load(chaos, weights_only=True)["models"][0]
    pairs = (
        list(zip(a.values(), b.values(), strict=True))
        if isinstance(a, dict)
        else list(zip(a, b, strict=True))
    )
    diff = max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
    return {
        "compared": True,
        "tensors": len(pairs),
        "bit_equal": all(torch.equal(x, y) for x, y in pairs),
        "max_abs_diff": diff,
    }


def stray_files(run_dir: Path, num_to_keep: int = 2) -> list[str]:
    """Anything in the run's checkpoint directory but committed checkpoints (at most ``num_to_keep``).

    Also partial files (``*.tmp``, hidden names) beside ``final.pt``.
    """
    from polytrain.checkpoint import layout

    strays = []
    ckpt = run_dir / "ckpt"
    committed = []
    for entry in sorted(ckpt.iterdir()) if ckpt.exists() else []:
        if layout.parse_name(entry.name) is None or not entry.is_dir():
            strays.append(f"ckpt/{entry.name}")
        elif not (entry / layout.MARKER).exists():
            strays.append(f"ckpt/{entry.name} (uncommitted)")
        else:
            committed.append(entry.name)
            for inner in entry.iterdir():
                if inner.name.startswith(".") or inner.suffix in (".tmp", ".failed"):
                    strays.append(f"ckpt/{entry.name}/{inner.name}")
    if len(committed) > num_to_keep:
        strays.extend(f"ckpt/{name} (beyond num_to_keep)" for name in committed[:-num_to_keep])
    for entry in run_dir.iterdir():
        if entry.name.startswith(".") or ".tmp" in entry.name:
            strays.append(entry.name)
    return strays


# --------------------------------------------------------------- per case
def run_case(case: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The reference and the chaos run of one case on a fresh simulated cluster."""
    framework = framework_of(case)
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    schedule = make_schedule(args.faults, args.seed, kinds, gap=args.gap)  # the same for every case
    last = schedule[-1].step if schedule else 0
    epochs = max(2, math.ceil((last + args.tail) / STEPS_PER_EPOCH))
    total = epochs * STEPS_PER_EPOCH
    options = Options(
        every_n_steps=args.every_n_steps,
        step_sleep_s=args.step_sleep_s,
        hang_timeout_s=args.hang_timeout_s,
        drain_deadline_s=args.drain_deadline_s,
    )
    result: dict[str, Any] = {
        "case": case,
        "framework": framework,
        "epochs": epochs,
        "total_steps": total,
        "schedule": [asdict(f) for f in schedule],
    }
    case_dir = out / case
    shutil.rmtree(case_dir, ignore_errors=True)
    print(f"[chaos] {case}: {len(schedule)} faults over {total} steps", flush=True)
    sim = None
    try:
        sim = SimCluster()
        references = []
        for i in range(2 if args.check_reference else 1):
            ref = ChaosRun(case, case_dir / f"reference{i or ''}", epochs, sim, options, [])
            wall = ref.run()
            references.append(ref)
            result[f"reference{i or ''}"] = {
                "wall_s": round(wall, 1),
                "error": ref.error,
                "segments": ref.segments,
                "stray_files": stray_files(ref.state.run_dir),
            }
            print(
                f"[chaos] {case}: reference{i or ''} in {wall:.0f} s ({ref.error or 'ok'})",
                flush=True,
            )
        if args.check_reference:
            result["references_equal"] = compare_weights(
                references[0].state.run_dir / "final.pt", references[1].state.run_dir / "final.pt"
            )
        chaos = ChaosRun(case, case_dir / "chaos", epochs, sim, options, schedule)
        wall = chaos.run()
        print(f"[chaos] {case}: chaos run in {wall:.0f} s ({chaos.error or 'ok'})", flush=True)
        result["chaos"] = {
            "wall_s": round(wall, 1),
            "error": chaos.error,
            "segments": chaos.segments,
            "faults": chaos.faults,
            "log": analyse(chaos, references[0].state.steps, total, args.every_n_steps),
        }
        result["weights"] = compare_weights(
            references[0].state.run_dir / "final.pt", chaos.state.run_dir / "final.pt"
        )
        result["leftovers"] = SimCluster.leftovers()
        result["processes_left"] = processes_left({**chaos.state.pids, **references[0].state.pids})
        result["stray_files"] = stray_files(chaos.state.run_dir)
        result["time_lost_s"] = round(wall - result["reference"]["wall_s"], 1)
    except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        if sim is not None:
            sim.shutdown()
    result["checks"] = checks(result)
    return result


def checks(result: dict[str, Any]) -> dict[str, bool]:
    """The pass/fail verdicts of one case."""
    chaos = result.get("chaos", {})
    faults = [f for f in chaos.get("faults", []) if f.get("injected")]
    weights = result.get("weights", {})
    tol = WEIGHT_TOL.get(result["case"], 0.0)
    log = chaos.get("log", {})
    leftovers = result.get("leftovers", {})
    return {
        "completed": "error" not in result
        and chaos.get("error") is None
        and weights.get("compared", False),
        "all_faults_injected": len(faults) == len(result["schedule"]),
        "weights_equal": bool(weights.get("compared")) and weights.get("max_abs_diff", 1.0) <= tol,
        "steps_lost_as_designed": all(
            f.get("steps_lost", 0) <= f.get("designed_max", 0) for f in faults
        ),
        "every_step_trained": not log.get("missing_steps")
        and log.get("last_step") == result["total_steps"],
        "no_leaked_actors": not leftovers.get("actors") and not leftovers.get("placement_groups"),
        "no_process_left": not result.get("processes_left"),
        "no_stray_files": not result.get("stray_files"),
        "no_stopped_worker_left": not any("stopped_process_left" in f for f in faults),
    }


# ------------------------------------------------------------------ report
def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown tables: per case, and per fault kind."""
    lines = [
        f"Seed {args.seed}, {args.faults} faults per backend, kinds: {args.kinds or ', '.join(KINDS)}; "
        f"every_n_steps={args.every_n_steps}, step sleep {args.step_sleep_s} s, drain deadline "
        f"{args.drain_deadline_s} s.",
        "",
        "| backend | faults survived | steps lost (designed max) | time lost (s) | final weights vs uninterrupted | "
        "leaked actors / PGs | worker processes left | stray files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        chaos = r.get("chaos", {})
        faults = [f for f in chaos.get("faults", []) if f.get("injected")]
        survived = sum(1 for f in faults if f.get("survived"))
        lost = sum(f.get("steps_lost", 0) for f in faults)
        designed = sum(f.get("designed_max", 0) for f in faults)
        w = r.get("weights", {})
        weights = (
            ("bit-equal" if w.get("bit_equal") else f"max diff {w.get('max_abs_diff'):.3g}")
            if w.get("compared")
            else "not compared"
        )
        left = r.get("leftovers", {})
        lines.append(
            f"| {r['case']} | {survived} / {len(r['schedule'])} | {lost} ({designed}) | "
            f"{sum(f.get('time_lost_s', 0) for f in faults):.0f} (wall {r.get('time_lost_s', '?')}) | "
            f"{weights} | {len(left.get('actors', []))} / {len(left.get('placement_groups', []))} | "
            f"{len(r.get('processes_left', []))} | {len(r.get('stray_files', []))} |"
        )
    lines += [
        "",
        "| backend | fault kind | faults | steps lost per fault (designed max) | time lost per fault, mean (s) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        faults = [f for f in r.get("chaos", {}).get("faults", []) if f.get("injected")]
        for kind in KINDS:
            of_kind = [f for f in faults if f["kind"] == kind]
            if not of_kind:
                continue
            lost = ", ".join(str(f.get("steps_lost", "?")) for f in of_kind)
            mean = statistics.mean(f.get("time_lost_s", 0.0) for f in of_kind)
            lines.append(
                f"| {r['case']} | {kind} | {len(of_kind)} | {lost} ({of_kind[0].get('designed_max')}) | {mean:.1f} |"
            )
    failed = [(r["case"], k) for r in results for k, ok in r["checks"].items() if not ok]
    lines += ["", "Failed checks: " + (", ".join(f"{c}: {k}" for c, k in failed) or "none") + "."]
    return "\n".join(lines) + "\n"


SECTION = "## Chaos run"
DEFINITIONS = """\
Each backend trains the same run twice on a simulated cluster (`ray.cluster_utils.Cluster`:
a CPU-less head, two 2-CPU worker nodes at a time on loopback addresses, 2 workers SPREAD,
`checkpoint_dir` with `resume=True`, torch `every_n_steps` as below, SGD with momentum, a
model with dropout for torch): once uninterrupted, once under the seeded fault schedule
(the same for every backend), each run a sequence of driver processes. Lost and drained
nodes are replaced at once by a fresh node, as an autoscaler would; a drained node still
up at its deadline is killed then.

- *faults survived*: training went on after the fault and the run completed.
- *steps lost*: steps trained a second time (rank 0 logs every step it completes), per
  fault. Designed: torch, at most `every_n_steps` for a worker SIGKILL, a frozen worker
  (SIGSTOP, caught by the hang watchdog) and a node removal, 0 for the announced faults
  (drains with and without a deadline, driver SIGTERM). TFTrainer's calls are whole
  epochs, checkpointed at their ends: up to an epoch (8 steps) for the unannounced faults,
  0 for the announced ones (it leaves a draining node when the running epoch ends, well
  before the deadline here, and stops there on SIGTERM).
- *time lost*: per fault, the wall time of its window (until the next fault) beyond what
  the window's new steps take at the reference run's pace; *wall*: the chaos run's wall
  time minus the reference's (driver restarts included).
- *final weights*: the chaos run's final model against the uninterrupted run's.
- *leaked actors / PGs*: actors not dead and placement groups not removed in the cluster
  once the last driver is gone; *worker processes left*: worker pids still running;
  *stray files*: anything in `checkpoint_dir` but committed checkpoints within
  `num_to_keep`, and partial files.
"""


def update_reliability(path: Path, text: str, command: str) -> None:
    """Replace (or append) the chaos section of RELIABILITY.md with this run's tables."""
    import datetime
    import platform

    section = (
        f"{SECTION}\n\nWritten by `{command}` on {datetime.date.today()}, {platform.machine()} "
        f"({os.cpu_count()} CPU cores); regenerated by `make chaos` (the method: "
        f"benchmarks/chaos.py).\n\n{DEFINITIONS}\n{text}"
    )
    old = path.read_text() if path.exists() else ""
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + section + (old[end + 1 :] if end >= 0 else "")
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    """Run the chaos run for every requested backend; 0 when every check passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends", default=",".join(ALL_CASES), help="cases: backend names or registry case ids"
    )
    parser.add_argument("--faults", type=int, default=20, help="faults per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "chaos"))
    parser.add_argument("--kinds", default="", help=f"comma-separated subset of {', '.join(KINDS)}")
    parser.add_argument("--every-n-steps", type=int, default=4)
    parser.add_argument("--step-sleep-s", type=float, default=0.05)
    parser.add_argument("--hang-timeout-s", type=float, default=8.0)
    parser.add_argument("--drain-deadline-s", type=float, default=10.0)
    parser.add_argument("--gap", type=int, default=10, help="steps between two scheduled faults")
    parser.add_argument("--tail", type=int, default=8, help="steps after the last fault")
    parser.add_argument(
        "--check-reference",
        action="store_true",
        help="a second reference run: are uninterrupted runs bit-equal?",
    )
    parser.add_argument(
        "--update-reliability",
        metavar="PATH",
        help="write the tables into the chaos section of this RELIABILITY.md",
    )
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.kinds.split(","))) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Ray's socket paths must stay short: a private, short RAY_TMPDIR (never the shared /tmp/ray).
    ray_tmp = tempfile.mkdtemp(prefix="ptch", dir="/tmp")
    os.environ["RAY_TMPDIR"] = ray_tmp
    os.environ.pop("RAY_ADDRESS", None)
    # A private cluster on loopback addresses, for this process and its drivers only.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    results = []
    start = time.monotonic()
    try:
        for case in filter(None, args.backends.split(",")):
            results.append(run_case(case, args, out))
            (out / "chaos.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(ray_tmp, ignore_errors=True)
    text = report(results, args) + f"\nTotal wall time {time.monotonic() - start:.0f} s.\n"
    (out / "chaos.md").write_text(text)
    if args.update_reliability:
        command = "python benchmarks/chaos.py " + " ".join(sys.argv[1:] if argv is None else argv)
        update_reliability(Path(args.update_reliability), text, command)
    print(text, flush=True)
    return 0 if all(all(r["checks"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
