"""One run of the chaos run: its driver segments, the faults injected into it, its raw records.

:class:`ChaosRun` starts a driver process (:mod:`benchmarks.chaos.driver`) per
segment, follows the steps log rank 0 writes, injects each scheduled fault from
outside once its step is reached and the fault before it has settled, and records
what happened: when the group restarted, when a drained node left, whether a frozen
worker went away. A driver SIGTERM ends a segment (exit 143) and the next one resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.chaos.cluster import SimCluster, process_state
from benchmarks.chaos.schedule import NUM_WORKERS, Fault, framework_of
from benchmarks.chaos.workload import STEPS_LOG, STEPS_PER_EPOCH

DRIVER = Path(__file__).with_name("driver.py")
#: A run with no new step for this long is stuck: its driver is killed and the run fails.
STALL_S = 240.0


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
