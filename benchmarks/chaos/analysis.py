"""What a chaos run's records say: steps and time lost per fault, the final weights, the checks.

Reads the steps log (a step logged twice was trained twice, i.e. lost once), the
runs' final states and their checkpoint directories, and turns a case's result into
pass/fail verdicts (:func:`checks`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.chaos.schedule import designed_loss

if TYPE_CHECKING:
    from benchmarks.chaos.orchestrator import ChaosRun

#: The largest final-weight difference accepted per case (0.0: bit for bit). Every case
#: is held to bit equality: the group keeps its size, its ranks keep their data shard
#: and random states, and the checkpoints hold the exact values.
WEIGHT_TOL: dict[str, float] = {}


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
