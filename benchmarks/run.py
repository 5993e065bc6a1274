"""Side-by-side benchmarks: polytrain against the native launchers and Ray Train.

``make bench`` runs this file. Every comparison runs in this one invocation,
interleaved (A, B, A, B, ...) so that a change in machine load hits both sides
alike; each number is the median over the repetitions and comparisons are
reported as ratios. Raw results go to ``benchmarks/out/<section>.json``; the
tables in ``benchmarks/RESULTS.md`` are regenerated from them.

Usage::

    python benchmarks/run.py                 # everything, 3 repetitions (~25 min on 2 cores)
    python benchmarks/run.py --quick         # a short smoke run (1 repetition, few steps, no Ray Train)
    python benchmarks/run.py --only ddp,horovod --reps 5
    python benchmarks/run.py --only warm     # start-up: cold path per phase, warm workers

``--only`` takes: ddp, raytrain, horovod, fairscale, deepspeed, fsdp, tf, warm
(see :mod:`benchmarks.warm_section`), launch (:mod:`benchmarks.launch_section`),
lightning (:mod:`benchmarks.lightning_section`).
The GPT-2 suites (memory per rank and speed on a transformer) are
:mod:`benchmarks.lm_bench`; their tables (:mod:`benchmarks.lm_report`) are part of
:func:`render`, so ``--render-only`` rebuilds them too.

What is measured, per run (one run = one fresh launch):

* launch to first step: wall time from starting the launcher process
  (``torchrun``, ``horovodrun``, the two TF processes, or the polytrain / Ray
  Train driver script) to the end of the first training step in the workers.
  For Ray-based runners the driver's ``ray.init`` is timed on its own and the
  number is also given without it (a session pays ``ray.init`` once).
* step time: inside the workers, the median over the steps after the warm-up of
  forward + loss + zero_grad + backward + step + ``loss.item()``; and the
  step-to-step interval, which adds data loading and the training loop's own
  overhead. For Keras only the interval exists (the end of one batch to the end
  of the next, from a batch-end callback).
* peak memory per rank: ``ru_maxrss`` of each worker process, and its growth
  from the RSS right before the model was built.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
OUT = BENCH / "out"
RESULTS = BENCH / "RESULTS.md"
sys.path.insert(0, str(ROOT))

from benchmarks import launch_section, lightning_section, warm_section  # noqa: E402
from benchmarks.cases import Case, _free_ports, _py, torch_cases  # noqa: E402
from benchmarks.workload import NUM_WORKERS, WorkloadSpec  # noqa: E402

TAGS = (
    "ddp",
    "raytrain",
    "horovod",
    "fairscale",
    "deepspeed",
    "fsdp",
    "tf",
    "warm",
    "launch",
    "lightning",
)


def build_sections(args: argparse.Namespace) -> dict[str, list[list[Case]]]:
    """Every section as a list of interleaving groups (each group runs A, B, A, B, ...)."""
    core = WorkloadSpec(model="mlp", steps=args.steps, warmup=args.warmup)
    big = WorkloadSpec(
        model="big",
        layers=args.big_layers,
        width=args.big_width,
        steps=args.big_steps,
        warmup=args.big_warmup,
    )
    s = core.to_json()
    raytrain_torch = Case(
        "core/raytrain-torch",
        "Ray Train TorchTrainer (ScalingConfig(num_workers=2))",
        "raytrain",
        "raytrain",
        [(_py("drivers/raytrain_torch.py", "--spec", s), {})],
        core,
        ("ray.train",),
        baseline="core/native-ddp",
    )
    tf_env = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    tf_cases = [
        Case(
            "tf/native-tf",
            "2 processes + hand-written TF_CONFIG",
            "tf",
            "native",
            [],  # TF_CONFIG ports are picked at launch time
            core,
            ("tensorflow", "tf_keras"),
        ),
        Case(
            "tf/polytrain-tf",
            'polytrain TFTrainer(backend="mwms")',
            "tf",
            "polytrain",
            [(_py("drivers/polytrain_tf.py", "--spec", s), tf_env)],
            core,
            ("tensorflow", "tf_keras"),
            baseline="tf/native-tf",
        ),
        Case(
            "tf/raytrain-tf",
            "Ray Train TensorflowTrainer (ScalingConfig(num_workers=2))",
            "raytrain",
            "raytrain",
            [(_py("drivers/raytrain_tf.py", "--spec", s), tf_env)],
            core,
            ("tensorflow", "tf_keras", "ray.train"),
            baseline="tf/native-tf",
        ),
    ]
    sharded_core = [
        c
        for tag in ("fairscale", "deepspeed", "fsdp")
        for c in torch_cases(tag, core, "sharded-mlp")
    ]
    sharded_big = [
        c
        for tag in ("ddp", "fairscale", "deepspeed", "fsdp")
        for c in torch_cases(tag, big, "sharded-big")
    ]
    return {
        "core": [torch_cases("ddp", core, "core") + [raytrain_torch]],
        "horovod": [torch_cases("horovod", core, "horovod")],
        "sharded": [sharded_core, sharded_big],
        "tf": [tf_cases],
        "warm": warm_section.groups(args.warm_steps),
        "launch": launch_section.groups(core),
        "lightning": lightning_section.groups(core),
    }


# -------------------------------------------------------------- running
def _missing(requires: tuple[str, ...]) -> str | None:
    for module in requires:
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except ModuleNotFoundError:
            return f"{module} is not installed"
    return None


def _commands_for(case: Case, result_dir: Path) -> list[tuple[list[str], dict[str, str]]]:
    if case.key == "tf/native-tf":
        ports = _free_ports(NUM_WORKERS)
        workers = [f"127.0.0.1:{p}" for p in ports]
        commands = []
        for index in range(NUM_WORKERS):
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            commands.append(
                (
                    _py("native/tf_native.py", "--spec", case.spec.to_json()),
                    {
                        "TF_CONFIG": json.dumps(tf_config),
                        "TF_USE_LEGACY_KERAS": "1",
                        "TF_CPP_MIN_LOG_LEVEL": "2",
                    },
                )
            )
        base = commands
    else:
        base = case.commands
    return [(argv + ["--result-dir", str(result_dir)], env) for argv, env in base]


def _kill(proc: subprocess.Popen) -> None:
    # Each launch is its own session: its whole process group goes (torchrun's and
    # horovodrun's children, a driver's local Ray instance).
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_case(case: Case, log_dir: Path) -> dict[str, Any]:
    """Launch ``case`` once and return its measurements (or its error)."""
    result_dir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env_base["PYTHONPATH"]] if env_base.get("PYTHONPATH") else [])
    )
    env_base.setdefault("RAY_DEDUP_LOGS", "0")
    log_path = log_dir / (case.key.replace("/", "__") + f".{int(time.time())}.log")
    load_before = os.getloadavg()[0]
    procs = []
    with open(log_path, "w") as log:
        t_launch = time.time()
        for argv, env in _commands_for(case, result_dir):
            procs.append(
                subprocess.Popen(
                    argv,
                    env={**env_base, **env},
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        error = None
        deadline = t_launch + case.timeout_s
        for proc in procs:
            try:
                rc = proc.wait(max(1.0, deadline - time.time()))
                if rc != 0 and error is None:
                    error = f"exit status {rc}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {case.timeout_s:g}s"
                break
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
    wall = time.time() - t_launch
    ranks = []
    for path in sorted(result_dir.glob("rank*.json")):
        ranks.append(json.loads(path.read_text()))
    driver_path = result_dir / "driver.json"
    driver = json.loads(driver_path.read_text()) if driver_path.exists() else None
    shutil.rmtree(result_dir, ignore_errors=True)
    if case.kind == "scenario" and driver is None and error is None:
        error = "the driver wrote no results"
    elif case.kind != "scenario" and len(ranks) < NUM_WORKERS and error is None:
        error = f"only {len(ranks)} of {NUM_WORKERS} workers wrote results"
    if error is not None:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-12:]
        return {"ok": False, "error": error, "log": str(log_path), "log_tail": tail, "wall_s": wall}
    return {
        "ok": True,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "log": str(log_path),
        **(
            warm_section.summarize_scenario(driver)
            if case.kind == "scenario"
            else summarize(case, t_launch, ranks, driver)
        ),
    }


def _median_after(values: list[float], warmup: int) -> float | None:
    tail = values[warmup:]
    return statistics.median(tail) if tail else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(
    case: Case, t_launch: float, ranks: list[dict[str, Any]], driver: dict[str, Any] | None
) -> dict[str, Any]:
    """Reduce the per-rank records of one run to its numbers."""
    warmup = case.spec.warmup
    first = max(r["marks"].get("first_step", float("nan")) for r in ranks)
    out: dict[str, Any] = {
        "launch_s": first - t_launch,
        # intervals[i] ends at step i + 1; the same steps as step_s[warmup:].
        "step_ms": _mean([_scale(_median_after(r["step_s"], warmup)) for r in ranks]),
        "interval_ms": _mean([_scale(_median_after(r["interval_s"], warmup - 1)) for r in ranks]),
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "delta_rss_mb": [
            r["peak_rss_mb"] - r["baseline_rss_mb"] if r.get("baseline_rss_mb") else None
            for r in ranks
        ],
        # Per rank (rank order): the set-up peak (model built and wrapped, before the first
        # step) and the training peak after it (VmHWM reset in between; None where not reset).
        "baseline_rss_mb": [r.get("baseline_rss_mb") for r in ranks],
        "setup_peak_rss_mb": [r.get("setup_peak_rss_mb") for r in ranks],
        "train_peak_rss_mb": [r.get("train_peak_rss_mb") for r in ranks],
        "niceness": [r["niceness"] for r in ranks],
        "torch_threads": [r["torch_threads"] for r in ranks],
        "python_threads": [r["python_threads"] for r in ranks],
        "steps": [len(r["step_s"]) for r in ranks],
    }
    phases: dict[str, float] = {}
    if driver is not None:
        marks = driver["marks"]
        phases = {f"driver_{k}": v - t_launch for k, v in marks.items()}
        if "ray_init_done" in marks:
            out["ray_init_s"] = marks["ray_init_done"] - marks["imported"]
            out["launch_excl_ray_init_s"] = out["launch_s"] - out["ray_init_s"]
    for name in (
        "script_start",
        "imported",
        "process_group",
        "loop_start",
        "model_build",
        "wrapped",
    ):
        values = [r["marks"][name] for r in ranks if name in r["marks"]]
        if values:
            phases[f"worker_{name}"] = max(values) - t_launch
    out["phases_s"] = phases
    return out


def _scale(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def run_sections(
    sections: dict[str, list[list[Case]]],
    tags: set[str],
    reps: int,
    run_id: str,
    command: str,
    out_dir: Path = OUT,
) -> dict[str, dict[str, Any]]:
    """Run every selected case ``reps`` times, interleaved within its group.

    Each section's results go to ``out_dir/<section>.json`` as soon as it is done.
    """
    log_dir = OUT / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, groups in sections.items():
        cases = [c for group in groups for c in group if c.tag in tags]
        if not cases:
            continue
        section: dict[str, Any] = {}
        results[name] = section
        load_start = os.getloadavg()
        for group in groups:
            selected = [c for c in group if c.tag in tags]
            for case in selected:
                section[case.key] = {
                    "label": case.label,
                    "tag": case.tag,
                    "kind": case.kind,
                    "baseline": case.baseline,
                    "spec": dataclasses.asdict(case.spec),
                    "run_id": run_id,
                    "runs": [],
                }
                reason = _missing(case.requires)
                if reason:
                    section[case.key]["skipped"] = reason
            for rep in range(reps):
                for case in selected:
                    entry = section[case.key]
                    if entry.get("skipped"):
                        continue
                    print(f"[{name}] rep {rep + 1}/{reps}: {case.key} ...", flush=True)
                    result = run_case(case, log_dir)
                    entry["runs"].append(result)
                    _report_run(case, entry, result)
        meta = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_start": load_start,
            "load_end": os.getloadavg(),
            "command": command,
        }
        for key in section:
            section[key]["meta"] = meta
        save_section(name, section, command, out_dir)  # an interrupted run keeps what it finished
    return results


def _report_run(case: Case, entry: dict[str, Any], result: dict[str, Any]) -> None:
    if result["ok"] and case.kind == "scenario":
        print(f"    {result['metrics']}  load {result['load_before']:.1f}", flush=True)
    elif result["ok"]:
        print(
            f"    launch {result['launch_s']:.1f}s  step "
            f"{_fmt(result['step_ms'], 2)} ms  interval "
            f"{_fmt(result['interval_ms'], 2)} ms  load {result['load_before']:.1f}",
            flush=True,
        )
    else:
        # A failing backend must not stop the others; its later reps are skipped.
        entry["skipped"] = f"failed: {result['error']} (log: {result['log']})"
        print(
            f"    {entry['skipped']}\n      " + "\n      ".join(result["log_tail"]),
            flush=True,
        )


def save_section(name: str, cases: dict[str, Any], command: str, out_dir: Path = OUT) -> None:
    """Merge ``cases`` into ``out/<name>.json``; cases not run this time keep their last results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    previous = json.loads(path.read_text())["cases"] if path.exists() else {}
    previous.update(cases)
    path.write_text(json.dumps({"command": command, "cases": previous}, indent=1))


# ------------------------------------------------------------ reporting
def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def aggregate(entry: dict[str, Any]) -> dict[str, Any]:
    """Medians over the successful repetitions of one case."""
    runs = [r for r in entry.get("runs", []) if r.get("ok")]
    agg: dict[str, Any] = {"n": len(runs)}
    for key in ("launch_s", "ray_init_s", "launch_excl_ray_init_s", "step_ms", "interval_ms"):
        values = [r[key] for r in runs if r.get(key) is not None]
        agg[key] = statistics.median(values) if values else None
    for key in ("peak_rss_mb", "delta_rss_mb"):
        values = [max(v for v in r[key] if v is not None) for r in runs if any(r[key])]
        agg[key] = statistics.median(values) if values else None
    agg["niceness"] = sorted({n for r in runs for n in r["niceness"]})
    agg["torch_threads"] = sorted({t for r in runs for t in r["torch_threads"] if t is not None})
    loads = [r["load_before"] for r in runs]
    agg["load"] = (min(loads), max(loads)) if loads else None
    return agg


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _goal(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} ({'met' if value <= limit else 'missed'}, goal <= {limit:g})"


def _status(entry: dict[str, Any]) -> str:
    return (
        f"skipped: {entry['skipped']}" if entry.get("skipped") and not aggregate(entry)["n"] else ""
    )


def _meta_line(section: dict[str, Any]) -> str:
    metas = {json.dumps(e.get("meta"), sort_keys=True) for e in section.values() if e.get("meta")}
    lines = []
    for text in sorted(metas):
        meta = json.loads(text)
        load_s = ", ".join(f"{x:.1f}" for x in meta["load_start"])
        load_e = ", ".join(f"{x:.1f}" for x in meta["load_end"])
        lines.append(
            f"_Measured {meta['date']} on {platform.node() or 'this machine'} "
            f"({os.cpu_count()} CPU cores, no GPU); load average (1, 5, 15 min) {load_s} at the "
            f"start, {load_e} at the end. Command: `{meta.get('command', '?')}`._"
        )
    return "\n".join(lines)


def render_time_table(
    section: dict[str, Any], keys: list[str], interval_only: bool = False
) -> list[str]:
    """Launch and step-time rows for ``keys`` (each against its baseline).

    ``interval_only``: the runners measure only the step-to-step interval (Keras,
    where a callback sees batch ends, and the native script's begin-to-end time
    would not compare with anything on the polytrain side); the step columns say n/a.
    """
    lines = [
        "| Runner | Launch to 1st step (s) | ray.init (s) | Launch excl. ray.init (s) "
        "| Step (ms) | Step interval (ms) | Step ratio | Interval ratio | Launch ratio (incl. / excl. ray.init) "
        "| Worker nice / threads | Reps | Load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        entry = section.get(key)
        if entry is None:
            continue
        status = _status(entry)
        if status:
            lines.append(f"| {entry['label']} | {status} |||||||||||")
            continue
        agg = aggregate(entry)
        base = aggregate(section[entry["baseline"]]) if entry.get("baseline") in section else None
        step_r = interval_r = launch_r = launch_x = None
        if base:
            step_r = _ratio(agg["step_ms"], base["step_ms"])
            interval_r = _ratio(agg["interval_ms"], base["interval_ms"])
            launch_r = _ratio(agg["launch_s"], base["launch_s"])
            launch_x = _ratio(agg["launch_excl_ray_init_s"], base["launch_s"])
        load = agg["load"]
        step_text = "n/a" if interval_only else _fmt(agg["step_ms"], 2)
        step_r_text = "n/a" if interval_only else _fmt(step_r, 3)
        lines.append(
            f"| {entry['label']} | {_fmt(agg['launch_s'])} | {_fmt(agg['ray_init_s'])} "
            f"| {_fmt(agg['launch_excl_ray_init_s'])} | {step_text} "
            f"| {_fmt(agg['interval_ms'], 2)} | {step_r_text if base else 'baseline'} "
            f"| {_fmt(interval_r, 3) if base else ''} "
            f"| {(_fmt(launch_r, 2) + ' / ' + _fmt(launch_x, 2)) if base else ''} "
            f"| {agg['niceness']} / {agg['torch_threads']} | {agg['n']} "
            f"| {f'{load[0]:.1f}-{load[1]:.1f}' if load else 'n/a'} |"
        )
    return lines


def zero_formula_mb(tag: str, num_params: int, n: int = NUM_WORKERS) -> tuple[str, float]:
    """The fp32-Adam version of the ZeRO paper's per-rank model-state bytes, in MiB.

    fp32 training keeps params 4P, grads 4P and Adam's two moments 8P (K = 8: the
    fp32 params are their own master copy, so the paper's K = 12 loses its 4P).
    """
    p = float(num_params)
    formulas = {
        "ddp": ("16P (replicated)", 16 * p),
        "fairscale": ("4P + (4+8)P/N (~stage 2)", 4 * p + 12 * p / n),
        "deepspeed": ("4P + (4+8)P/N (stage 2)", 4 * p + 12 * p / n),
        "fsdp": ("16P/N (stage 3)", 16 * p / n),
    }
    text, value = formulas[tag]
    return text, value / 2**20


def render_sharded(section: dict[str, Any], prefix: str, title: str) -> list[str]:
    """Step time and memory of every backend against its native run on one model."""
    keys = [k for k in section if k.startswith(prefix + "/polytrain-")]
    if not keys:
        return []
    spec = WorkloadSpec(**section[keys[0]]["spec"])
    p = spec.num_params()
    lines = [
        f"#### {title}: P = {p:,} parameters ({p * 4 / 2**20:.0f} MiB in fp32), "
        f"{spec.steps} steps, warm-up {spec.warmup}",
        "",
        "| Backend | Native step (ms) | polytrain step (ms) | Step ratio (goal <= 1.05) "
        "| Native launch (s) | polytrain launch excl. ray.init (s) "
        "| Peak RSS/rank native / polytrain (MiB) | Growth/rank native / polytrain (MiB) "
        "| fp32-Adam model states (formula, MiB) | Reps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        entry = section[key]
        native = section.get(entry["baseline"], {})
        tag = entry["tag"]
        status = _status(entry) or _status(native)
        if status:
            lines.append(f"| {tag} | {status} |||||||||")
            continue
        a, b = aggregate(native), aggregate(entry)
        text, formula = zero_formula_mb(tag, p)
        lines.append(
            f"| {tag} | {_fmt(a['step_ms'], 2)} | {_fmt(b['step_ms'], 2)} "
            f"| {_goal(_ratio(b['step_ms'], a['step_ms']), 1.05)} "
            f"| {_fmt(a['launch_s'])} | {_fmt(b['launch_excl_ray_init_s'])} "
            f"| {_fmt(a['peak_rss_mb'], 0)} / {_fmt(b['peak_rss_mb'], 0)} "
            f"| {_fmt(a['delta_rss_mb'], 0)} / {_fmt(b['delta_rss_mb'], 0)} "
            f"| {text} = {formula:.0f} | {a['n']}/{b['n']} |"
        )
    return lines + [""]


def _goals(
    section: dict[str, Any],
    key: str,
    step_goal: float,
    launch_goal: float | None,
    interval_only: bool = False,
) -> list[str]:
    entry = section.get(key)
    if not entry or _status(entry) or entry.get("baseline") not in section:
        return []
    agg, base = aggregate(entry), aggregate(section[entry["baseline"]])
    interval_r = _ratio(agg["interval_ms"], base["interval_ms"])
    if interval_only:
        lines = [f"- {entry['label']}: step interval ratio {_goal(interval_r, step_goal)}."]
    else:
        lines = [
            f"- {entry['label']}: step ratio "
            f"{_goal(_ratio(agg['step_ms'], base['step_ms']), step_goal)}; "
            f"interval ratio {_fmt(interval_r, 3)}."
        ]
    if launch_goal is not None:
        lines.append(
            f"- {entry['label']}: launch ratio incl. ray.init "
            f"{_goal(_ratio(agg['launch_s'], base['launch_s']), launch_goal)}; excl. ray.init "
            f"{_goal(_ratio(agg['launch_excl_ray_init_s'], base['launch_s']), launch_goal)}."
        )
    return lines


def render(all_results: dict[str, dict[str, Any]]) -> str:
    """The generated part of RESULTS.md."""
    out = []
    core = all_results.get("core")
    if core:
        out += ["### 1. DDP: torchrun vs polytrain vs Ray Train (MLP 784-512-512-10)", ""]
        out += [_meta_line(core), ""]
        out += render_time_table(
            core, ["core/native-ddp", "core/polytrain-ddp", "core/raytrain-torch"]
        )
        out += [""] + _goals(core, "core/polytrain-ddp", 1.03, 1.5) + [""]
    hvd = all_results.get("horovod")
    if hvd:
        out += ["### 2. Horovod: horovodrun vs polytrain (MLP 784-512-512-10)", ""]
        out += [_meta_line(hvd), ""]
        out += render_time_table(hvd, ["horovod/native-horovod", "horovod/polytrain-horovod"])
        out += [""] + _goals(hvd, "horovod/polytrain-horovod", 1.03, 1.5)
        if core and "core/polytrain-ddp" in core and "horovod/polytrain-horovod" in hvd:
            a = aggregate(hvd["horovod/polytrain-horovod"])
            b = aggregate(core["core/polytrain-ddp"])
            out.append(
                f"- Horovod vs DDP under polytrain: step {_fmt(_ratio(a['step_ms'], b['step_ms']), 3)}x, "
                f"interval {_fmt(_ratio(a['interval_ms'], b['interval_ms']), 3)}x "
                f"(same invocation, different interleaving groups)."
            )
        out.append("")
    sharded = all_results.get("sharded")
    if sharded:
        out += ["### 3. Sharded backends: native torchrun scripts vs polytrain", ""]
        out += [_meta_line(sharded), ""]
        out += render_sharded(sharded, "sharded-mlp", "MLP 784-512-512-10")
        out += render_sharded(sharded, "sharded-big", "Large model (optimizer state dominates)")
    tf = all_results.get("tf")
    if tf:
        out += ["### 4. TensorFlow MultiWorkerMirroredStrategy (Keras MLP 784-512-512-10)", ""]
        out += [_meta_line(tf), ""]
        out += render_time_table(
            tf, ["tf/native-tf", "tf/polytrain-tf", "tf/raytrain-tf"], interval_only=True
        )
        out += [""] + _goals(tf, "tf/polytrain-tf", 1.03, 1.5, interval_only=True)
        out += [
            "",
            "(Keras: every runner times the interval from one batch end to the next in a "
            "batch-end callback; there is no separate step time.)",
            "",
        ]
    warm = all_results.get("warm")
    if warm:
        out += warm_section.render(warm, _meta_line(warm))
    launch = all_results.get("launch")
    if launch:
        out += launch_section.render(launch, _meta_line(launch), render_time_table)
    lightning = all_results.get("lightning")
    if lightning:
        out += lightning_section.render(
            lightning, _meta_line(lightning), render_time_table, aggregate
        )
    from benchmarks import lm_report  # it imports this module's helpers

    out += lm_report.render(all_results)
    return "\n".join(out).rstrip() + "\n"


GENERATED_START = "<!-- generated by benchmarks/run.py: do not edit below -->"


def _split_sections(text: str) -> dict[str, str]:
    """The ``### ...`` sections of a generated text, keyed by their heading line."""
    sections: dict[str, str] = {}
    heading = None
    for line in text.splitlines(keepends=True):
        if line.startswith("### "):
            heading = line.strip()
            sections[heading] = ""
        if heading is not None:
            sections[heading] += line
    return sections


def _section_order(heading: str) -> tuple[int, str]:
    # "### 10. ..." after "### 9. ...": by the number, not the text.
    number = heading[4:].split(".", 1)[0]
    return (int(number), heading) if number.isdigit() else (10**6, heading)


def write_results_md(all_results: dict[str, dict[str, Any]]) -> None:
    """Replace the generated part of RESULTS.md, keeping the hand-written part above it.

    A section with no saved results in ``out/`` (e.g. one that this checkout has not
    run: ``out/`` is not versioned) keeps its previous text, so ``--only tf`` replaces
    the TensorFlow section and leaves the others as they were.
    """
    head, old = "", ""
    if RESULTS.exists():
        head, _, old = RESULTS.read_text().partition(GENERATED_START)
    if not head.strip():
        head = "# Benchmark results\n\n"
    sections = _split_sections(old)
    sections.update(_split_sections(render(all_results)))
    body = "\n".join(sections[key].rstrip() + "\n" for key in sorted(sections, key=_section_order))
    RESULTS.write_text(head.rstrip() + "\n\n" + GENERATED_START + "\n\n" + body)


def load_saved(out_dir: Path = OUT) -> dict[str, dict[str, Any]]:
    """The latest saved results of every section (``benchmarks/out/<section>.json``)."""
    saved = {}
    for path in sorted(out_dir.glob("*.json")):
        try:
            saved[path.stem] = json.loads(path.read_text())["cases"]
        except (json.JSONDecodeError, KeyError):
            continue
    return saved


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, save the raw results and regenerate RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 repetition, few steps, small big model"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated subset of {TAGS} (default: all; --quick: all but raytrain)",
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions (default 3; --quick: 1)"
    )
    parser.add_argument("--steps", type=int, default=None, help="MLP steps per run")
    parser.add_argument("--big-layers", type=int, default=None)
    parser.add_argument("--big-width", type=int, default=None)
    parser.add_argument("--big-steps", type=int, default=None)
    parser.add_argument("--warm-steps", type=int, default=None, help="steps per trainer (warm)")
    parser.add_argument("--render-only", action="store_true", help="rebuild RESULTS.md from out/")
    args = parser.parse_args(argv)
    # Ray Train's launches take ~1 min each here: a smoke run leaves them out unless asked.
    default_tags = [t for t in TAGS if t != "raytrain"] if args.quick else list(TAGS)
    tags = {t.strip() for t in (args.only or ",".join(default_tags)).split(",") if t.strip()}
    unknown = tags - set(TAGS)
    if unknown:
        parser.error(f"--only got {sorted(unknown)}; choose from {', '.join(TAGS)}")
    quick = args.quick
    args.reps = args.reps or (1 if quick else 3)
    args.steps = args.steps or (100 if quick else 300)
    args.warmup = 20
    args.big_layers = args.big_layers or (4 if quick else 12)
    args.big_width = args.big_width or (1000 if quick else 2000)
    args.big_steps = args.big_steps or (5 if quick else 6)
    args.big_warmup = 2
    args.warm_steps = args.warm_steps or (10 if quick else 30)
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        print(f"load average at start: {os.getloadavg()}", flush=True)
        run_sections(build_sections(args), tags, args.reps, run_id, command)
        print(f"load average at end: {os.getloadavg()}", flush=True)
    write_results_md(load_saved())
    print(render(load_saved()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
