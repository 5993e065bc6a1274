"""Mesh layouts on 4 workers: polytrain vs a native torchrun script, memory against the formulas.

For each layout (FSDP 4, HSDP 2x2, TP 2 x FSDP 2) and each repetition, the native
script (native_mesh.py under ``torchrun --nproc_per_node=4``) and polytrain
(polytrain_mesh.py) run back to back, their order alternating between
repetitions, so a change in the machine's load hits both. Reported: the median
step time of each, their ratio, each rank's held bytes (parameters and optimizer
state, counted on the real tensors) against :func:`workload.formula_bytes`, and
the peak resident memory of the ranks; the 1-minute load average before every run.

``--turns W``: the two jobs run side by side instead and take turns (turns.py), ``W``
windows of ``--steps`` steps each; reported per layout are each job's median window,
every polytrain window's ratio to the native windows around it and each side's page
faults per rank and step. Both jobs' ranks are resident together: with AdamW, 8 ranks
of the 355M model reach 95 % of a 24 GiB machine on FSDP 4 and TP 2 x FSDP 2 (Ray's
memory monitor then stops a worker) and HSDP 2 x 2 holds twice the shards, so
``--optimizer sgd`` (no optimizer state) is what fits there. ``--backend-config`` and
``--polytrain-env KEY=VALUE`` change polytrain's side only (a trial); ``--resume`` keeps
the layouts a stopped suite measured (its partial results file).

Usage: python benchmarks/parallel/bench.py [--size 350m|tiny] [--reps 3] [--steps 4] [--warmup 2]
       [--layouts fsdp4,hsdp2x2,tp2xfsdp2] [--optimizer adamw|sgd] [--turns W [--resume]]
       [--backend-config JSON] [--polytrain-env KEY=VALUE] [--out benchmarks/out/parallel]
       [--update-results]
(``--warmup`` is for back-to-back runs, ``--resume`` for turns; the other mode refuses it.)
``--update-results`` writes the section into benchmarks/RESULTS.md between its markers
(the turns mode has a section of its own).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.parallel import turns, workload  # noqa: E402

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- parallel:begin -->", "<!-- parallel:end -->"
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "plain SGD"}
TURNS_BEGIN, TURNS_END = "<!-- parallel-turns:begin -->", "<!-- parallel-turns:end -->"
#: A private, short directory for the Ray instances of the polytrain runs (socket paths).
RAY_TMPDIR = tempfile.mkdtemp(prefix="ptparray", dir="/tmp")


@dataclasses.dataclass(frozen=True)
class PolytrainSide:
    """What a trial changes on polytrain's side only (``--backend-config``, ``--polytrain-env``)."""

    backend_config: str = "{}"
    env: tuple[tuple[str, str], ...] = ()

    def arguments(self) -> list[str]:
        """polytrain_mesh.py's arguments for it."""
        return ["--backend-config", self.backend_config]

    def record(self) -> dict:
        """As kept with each run (and told apart by ``--resume``)."""
        return {"backend_config": json.loads(self.backend_config), "polytrain_env": dict(self.env)}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # polytrain_mesh.py starts its own Ray: never another cluster running on this host.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra or {})  # polytrain's trial: Ray's workers inherit the driver's environment
    env["RAY_TMPDIR"] = RAY_TMPDIR
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Run ``command`` (with ``env`` added); on failure, raise with the tail of its output."""
    proc = subprocess.run(
        command, env=_env(env), timeout=timeout_s, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(
            f"{' '.join(command[:4])} ... exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-6000:]}"
        )


def run_native(spec: workload.Spec, timeout_s: float, side: PolytrainSide) -> dict:
    with tempfile.TemporaryDirectory(prefix="ptpar-") as out:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*torchrun, f"--nproc_per_node={workload.NUM_WORKERS}"]
        command += [str(HERE / "native_mesh.py"), "--spec", spec.to_json(), "--out", out]
        _run(command, timeout_s)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("native_rank*.json"))]
    return {
        "step_s": max(r["step_s"] for r in ranks),
        # Each step's slowest rank.
        "step_times": [max(t) for t in zip(*(r["step_times"] for r in ranks), strict=True)],
        "held": [r["held"] for r in sorted(ranks, key=lambda r: r["rank"])],
        "peak_rss_mb": [r["peak_rss_mb"] for r in sorted(ranks, key=lambda r: r["rank"])],
    }


def run_polytrain(spec: workload.Spec, timeout_s: float, side: PolytrainSide) -> dict:
    with tempfile.TemporaryDirectory(prefix="ptpar-") as out:
        command = [sys.executable, str(HERE / "polytrain_mesh.py"), "--spec", spec.to_json()]
        _run([*command, "--out", out, *side.arguments()], timeout_s, dict(side.env))
        result = json.loads((Path(out) / "polytrain.json").read_text())
    workers = sorted(result["workers"], key=lambda w: w["rank"])
    return {
        "step_s": result["step_s"],
        "worker_loop_step_s": result["worker_loop_step_s"],
        "held": [w["held"] for w in workers],
        "peak_rss_mb": [w["peak_rss_mb"] for w in workers],
    }


RUNNERS = {"native": run_native, "polytrain": run_polytrain}


def run_once_more_on_a_crash(
    runner: str, spec: workload.Spec, timeout_s: float, side: PolytrainSide
) -> dict:
    """``RUNNERS[runner]``; a run that dies (a rank's crash) is run once more, and says so.

    On 4 CPU processes over 2 cores a rank of the native TP run died once (a SIGSEGV
    inside gloo's TCP transport) and took an hour's suite with it; the failure's line is
    kept with the result (``retried``), and a second failure is raised.
    """
    try:
        return RUNNERS[runner](spec, timeout_s, side)
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        cause = next((line for line in lines if "SIGSEGV" in line or "Error" in line), lines[-1])
        print(f"[parallel] {runner} {spec.layout} failed, running it once more: {cause}")
        return {**RUNNERS[runner](spec, timeout_s, side), "retried": cause.strip()[:300]}


def run_turns(spec: workload.Spec, windows: int, timeout_s: float, side: PolytrainSide) -> dict:
    """The native script and polytrain side by side, taking ``windows`` turns each.

    The native script starts once polytrain's workers have set up and given their
    set-up's free memory back, so that the two set-up peaks never meet (polytrain's
    TP set-up peaks at about 4.5 GiB a rank); a job that fails takes the other one
    down with it.
    """
    with tempfile.TemporaryDirectory(prefix="ptturn-") as shared:
        common = ["--spec", spec.to_json(), "--out", shared, "--turns", shared]
        common += ["--windows", str(windows)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        commands = {
            "native": [*torchrun, f"--nproc_per_node={workload.NUM_WORKERS}"]
            + [str(HERE / "native_mesh.py"), *common],
            "polytrain": [sys.executable, str(HERE / "polytrain_mesh.py"), *common]
            + side.arguments(),
        }
        procs: dict[str, subprocess.Popen] = {}
        deadline = time.monotonic() + timeout_s
        try:
            for job in reversed(turns.JOBS):
                log = open(Path(shared) / f"{job}.log", "w")  # noqa: SIM115 (the process owns it)
                procs[job] = subprocess.Popen(
                    commands[job],
                    env=_env(dict(side.env) if job == "polytrain" else None),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # torchrun's ranks and Ray's workers go with it
                )
                while job == "polytrain" and not (Path(shared) / "polytrain.ready").exists():
                    _check_turns(procs, shared, deadline)
                    time.sleep(1)
            while any(proc.poll() is None for proc in procs.values()):
                _check_turns(procs, shared, deadline)
                time.sleep(1)
            _check_turns(procs, shared, deadline)
        finally:
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the job's whole process group
                proc.wait()
        native = turns.read_windows(shared, "native")
        polytrain = turns.read_windows(shared, "polytrain")
        faults = {job: turns.read_faults(shared, job) for job in turns.JOBS}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(shared).glob("native_rank*.json"))]
        mine = json.loads((Path(shared) / "polytrain.json").read_text())
    workers = sorted(mine["workers"], key=lambda w: w["rank"])
    ranks.sort(key=lambda r: r["rank"])
    return {
        "native_windows": native,
        "polytrain_windows": polytrain,
        "ratios": [round(r, 4) for r in turns.sandwich_ratios(native, polytrain)],
        # Each window's page faults per rank (fresh pages the kernel zeroed and mapped).
        "native_faults": faults["native"],
        "polytrain_faults": faults["polytrain"],
        "held": [w["held"] for w in workers],
        "peak_rss_mb": [w["peak_rss_mb"] for w in workers],
        "native_held": [r["held"] for r in ranks],
        "native_peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
    }


def _check_turns(procs: dict[str, subprocess.Popen], shared: str, deadline: float) -> None:
    """Raise (with the job's log) when a job failed or the run is past its time."""
    for job, proc in procs.items():
        if proc.poll():
            log = (Path(shared) / f"{job}.log").read_text()
            raise RuntimeError(f"{job} exited {proc.returncode} while taking turns:\n{log[-6000:]}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"the turns run did not end in time; jobs: {list(procs)}")


def _suite(args: argparse.Namespace, name: str, **settings: object) -> tuple[dict, Path]:
    """A suite's results so far (no runs yet) and the file they are kept in as it goes."""
    data = {"size": args.size, "params": workload.num_params(args.size), "steps": args.steps}
    partial = Path(args.out) / f"{name}_{args.size}.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    return {**data, **settings, "runs": []}, partial


def _resume_key(run: dict) -> tuple:
    """A measured run's layout and trial: ``--resume`` skips those it finds again."""
    trial = {
        "backend_config": run.get("backend_config", {}),
        "polytrain_env": run.get("polytrain_env", {}),
    }
    return (
        run["rep"],
        run["layout"],
        run.get("optimizer", "adamw"),
        json.dumps(trial, sort_keys=True),
    )


def measure_turns(args: argparse.Namespace) -> dict:
    data, partial = _suite(args, "partial_turns", windows=args.turns)
    if args.resume and partial.exists():  # a suite that stopped: keep the layouts it measured
        data["runs"] = json.loads(partial.read_text())["runs"]
    trial = json.dumps(args.side.record(), sort_keys=True)
    done = {_resume_key(run) for run in data["runs"]}
    for rep in range(args.reps):
        for layout in args.layouts:
            if (rep, layout, args.optimizer, trial) in done:
                continue
            spec = workload.Spec(args.size, layout, args.steps, 0, args.optimizer)
            load = os.getloadavg()[0]
            start = time.monotonic()
            result = run_turns(spec, args.turns, args.timeout_s, args.side)
            data["runs"].append(
                {
                    "rep": rep, "layout": layout, "optimizer": args.optimizer,
                    **args.side.record(),
                    "load_1m": round(load, 2), "wall_s": round(time.monotonic() - start, 1),
                    **result,
                }
            )  # fmt: skip
            partial.write_text(json.dumps(data, indent=1))
            ratios = result["ratios"]
            print(
                f"[parallel] turns rep {rep} {layout:10s} window ratios {ratios} "
                f"(median {workload.median(ratios):.3f}; load before {load:.2f})",
                flush=True,
            )
    return data


def summarize_turns(data: dict) -> list[dict]:
    rows = []
    for layout, optimizer in itertools.product(workload.LAYOUTS, workload.OPTIMIZERS):
        mine = [
            r
            for r in data["runs"]
            if r["layout"] == layout and r.get("optimizer", "adamw") == optimizer
        ]
        if not mine:
            continue
        # Window 0 of each job is warm-up (turns.sandwich_ratios leaves it out too).
        native = [s for r in mine for s in r["native_windows"][1:]]
        polytrain = [s for r in mine for s in r["polytrain_windows"][1:]]
        ratios = [x for r in mine for x in r["ratios"]]
        formula = workload.formula_bytes(data["size"], layout, optimizer)
        rows.append(
            {
                "layout": layout,
                "optimizer": optimizer,
                "windows": len(ratios),
                "native_step_s": round(workload.median(native), 3),
                "polytrain_step_s": round(workload.median(polytrain), 3),
                "ratio_of_medians": workload.ratio(
                    workload.median(polytrain), workload.median(native)
                ),
                "median_window_ratio": round(workload.median(ratios), 3),
                "native_faults_per_step": _faults_per_step(mine, "native", data["steps"]),
                "polytrain_faults_per_step": _faults_per_step(mine, "polytrain", data["steps"]),
                "window_ratios": [round(x, 3) for x in ratios],
                "formula_gib": workload.gib(formula["params"] + formula["optimizer"]),
                "held_gib": [workload.gib(h["params"] + h["optimizer"]) for h in mine[-1]["held"]],
                "loads": [r["load_1m"] for r in mine],
            }
        )
    return rows


def _faults_per_step(runs: list[dict], job: str, steps: int) -> int:
    """The median over the measured windows and ranks of a rank's page faults per step."""
    counts = [c / steps for r in runs for w in r.get(f"{job}_faults", [])[1:] for c in w]
    return round(workload.median(counts)) if counts else 0


def turns_section(data: dict, rows: list[dict]) -> str:
    params = data["params"] / 1e6
    lines = [
        TURNS_BEGIN,
        "### Taking turns: the two jobs side by side",
        "",
        f"The same model ({params:.1f}M) and step; `bench.py --turns {data['windows']}`: "
        f"the native torchrun script and polytrain set up side by side, then train in "
        f"alternating windows of {data['steps']} steps (one job at a time, the other idle), "
        f"{data['windows']} windows each, the first one left out as warm-up. Window ratio: "
        f"a polytrain window's step time over the mean of the native windows before and "
        f"after it, so that the machine's drift over minutes cancels.",
        "",
        "| layout | optimizer | windows | native step (s, median) | polytrain step (s, median) "
        "| ratio of medians | median window ratio | window ratios | page faults per rank and "
        "step, native / polytrain | held per rank, formula / measured (GiB) | load 1m before |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layout']} | {OPTIMIZER_NAMES[row['optimizer']]} | {row['windows']} | "
            f"{row['native_step_s']} | "
            f"{row['polytrain_step_s']} | {row['ratio_of_medians']} | "
            f"{row['median_window_ratio']} | {', '.join(map(str, row['window_ratios']))} | "
            f"{row['native_faults_per_step']} / {row['polytrain_faults_per_step']} | "
            f"{row['formula_gib']} / {', '.join(map(str, row['held_gib']))} | "
            f"{', '.join(map(str, row['loads']))} |"
        )
    lines.append(TURNS_END)
    return "\n".join(lines)


def measure(args: argparse.Namespace) -> dict:
    data, partial = _suite(args, "partial", warmup=args.warmup, optimizer=args.optimizer)
    for rep in range(args.reps):
        for layout in args.layouts:
            order = ["native", "polytrain"] if rep % 2 == 0 else ["polytrain", "native"]
            for runner in order:
                spec = workload.Spec(args.size, layout, args.steps, args.warmup, args.optimizer)
                load = os.getloadavg()[0]
                start = time.monotonic()
                result = run_once_more_on_a_crash(runner, spec, args.timeout_s, args.side)
                data["runs"].append(
                    {
                        "rep": rep, "layout": layout, "runner": runner, "load_1m": round(load, 2),
                        "wall_s": round(time.monotonic() - start, 1), **args.side.record(),
                        **result,
                    }
                )  # fmt: skip
                partial.write_text(json.dumps(data, indent=1))  # a long run's results so far
                loop = result.get("worker_loop_step_s")
                print(
                    f"[parallel] rep {rep} {layout:10s} {runner:9s} step {result['step_s']:.3f} s"
                    + (f", native loop in its workers {loop:.3f} s" if loop else "")
                    + f" (load {load:.2f})",
                    flush=True,
                )
    return data


def summarize(data: dict) -> list[dict]:
    rows = []
    for layout in workload.LAYOUTS:
        mine = [r for r in data["runs"] if r["layout"] == layout]
        if not mine:
            continue
        steps = {
            name: workload.median([r["step_s"] for r in mine if r["runner"] == name])
            for name in RUNNERS
        }
        loops = [r["worker_loop_step_s"] for r in mine if r["runner"] == "polytrain"]
        pairs = [
            workload.ratio(by["polytrain"]["step_s"], by["native"]["step_s"])
            for by in _by_rep(mine).values()
            if len(by) == 2
        ]
        polytrain = [r for r in mine if r["runner"] == "polytrain"][-1]
        native = [r for r in mine if r["runner"] == "native"][-1]
        formula = workload.formula_bytes(data["size"], layout, data["optimizer"])
        rows.append(
            {
                "layout": layout,
                "native_step_s": round(steps["native"], 3),
                "polytrain_step_s": round(steps["polytrain"], 3),
                "ratio": workload.ratio(steps["polytrain"], steps["native"]),
                "pair_ratios": pairs,
                "worker_loop_step_s": round(workload.median(loops), 3),
                "worker_loop_ratio": workload.ratio(workload.median(loops), steps["native"]),
                "formula_gib": workload.gib(formula["params"] + formula["optimizer"]),
                "held_gib": [workload.gib(h["params"] + h["optimizer"]) for h in polytrain["held"]],
                "native_held_gib": [
                    workload.gib(h["params"] + h["optimizer"]) for h in native["held"]
                ],
                "peak_rss_gib": [round(m / 1024, 2) for m in polytrain["peak_rss_mb"]],
                "native_peak_rss_gib": [round(m / 1024, 2) for m in native["peak_rss_mb"]],
                "loads": [r["load_1m"] for r in mine],
            }
        )
    return rows


def _by_rep(runs: list[dict]) -> dict[int, dict[str, dict]]:
    """One layout's runs as ``{rep: {runner: run}}``: the back-to-back pairs."""
    pairs: dict[int, dict[str, dict]] = {}
    for run in runs:
        pairs.setdefault(run["rep"], {})[run["runner"]] = run
    return pairs


def section(data: dict, rows: list[dict]) -> str:
    params = data["params"] / 1e6
    shape = workload.SIZES[data["size"]]
    lines = [
        BEGIN,
        "## Mesh parallelism: HSDP and tensor parallelism (issue 42)",
        "",
        f"Llama-style model, {params:.1f}M parameters ({shape['layers']} layers, "
        f"d={shape['hidden']}, MLP {shape['mlp']}, vocab {shape['vocab']}), "
        f"sequence {workload.SIZES[data['size']]['seq']}, one sequence per data-parallel rank, "
        f"{OPTIMIZER_NAMES[data['optimizer']]}, 4 workers on gloo/CPU, one thread each. "
        f"`benchmarks/parallel/bench.py`: "
        f"native torchrun script (torch's DeviceMesh, parallelize_module, fully_shard) and "
        f"polytrain (`TorchTrainer(backend='fsdp', parallelism=...)`) interleaved, median of "
        f"{max(r['rep'] for r in data['runs']) + 1} runs each, {data['steps']} timed steps "
        f"after {data['warmup']} warm-up step(s) per run. Ratio: polytrain's median over "
        f"native's; per pair: each back-to-back pair's own ratio. Native loop in polytrain's "
        f"workers: the native script's timed steps run inside polytrain's worker processes "
        f"on the model polytrain prepared, right after its timed call (what the processes "
        f"cost without polytrain's step), and its ratio to native.",
        "",
        "| layout | native step (s) | polytrain step (s) | ratio | ratio per pair | native loop "
        "in polytrain's workers (s, ratio) | held per rank, formula (GiB) | held per rank, "
        "measured (GiB) | peak RSS per rank (GiB) | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layout']} | {row['native_step_s']} | {row['polytrain_step_s']} | "
            f"{row['ratio']} | {', '.join(map(str, row['pair_ratios']))} | "
            f"{row['worker_loop_step_s']} ({row['worker_loop_ratio']}) | "
            f"{row['formula_gib']} | {', '.join(map(str, row['held_gib']))} | "
            f"{', '.join(map(str, row['peak_rss_gib']))} | "
            f"{min(row['loads'])}-{max(row['loads'])} |"
        )
    lines += [
        "",
        "Held: the local shards of the fp32 parameters and of AdamW's two state tensors "
        "(gradients are laid out like the parameters); formula: 3 x 4 bytes x P / (dp_shard x tp) "
        "(1 x with plain SGD).",
        END,
    ]
    return "\n".join(lines)


def update_results(text: str, path: Path, begin: str = BEGIN, end: str = END) -> None:
    current = path.read_text() if path.exists() else ""
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + text + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(current)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="350m", choices=sorted(workload.SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=workload.Spec.steps)
    parser.add_argument("--warmup", type=int, help=f"back to back (default {workload.Spec.warmup})")
    parser.add_argument("--layouts", default=",".join(workload.LAYOUTS))
    parser.add_argument("--optimizer", default="adamw", choices=workload.OPTIMIZERS)
    parser.add_argument(
        "--backend-config", default="{}", help="polytrain's fsdp backend_config (JSON), a trial"
    )
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "out" / "parallel"))
    parser.add_argument("--turns", type=int, default=0, help="windows per job (0: back to back)")
    parser.add_argument(
        "--resume", action="store_true", help="turns: keep the runs of the partial results file"
    )
    parser.add_argument(
        "--polytrain-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for polytrain's job only, a trial (repeatable)",
    )
    parser.add_argument("--update-results", action="store_true")
    args = parser.parse_args()
    if args.turns and args.warmup is not None:
        parser.error("--warmup is for back-to-back runs: with --turns the first window warms up")
    if args.resume and not args.turns:
        parser.error("--resume keeps a stopped --turns suite's runs; add --turns W")
    if args.warmup is None:
        args.warmup = workload.Spec.warmup
    unset = [item for item in args.polytrain_env if "=" not in item]
    if unset:
        parser.error(f"--polytrain-env takes KEY=VALUE; got {unset}")
    args.side = PolytrainSide(
        args.backend_config, tuple(tuple(item.split("=", 1)) for item in args.polytrain_env)
    )
    try:
        args.side.record()
    except json.JSONDecodeError as exc:
        parser.error(f"--backend-config must be a JSON object; got {args.backend_config!r}: {exc}")
    args.layouts = args.layouts.split(",")
    try:
        data = measure_turns(args) if args.turns else measure(args)
    finally:
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
    if args.turns:
        rows = summarize_turns(data)
        out = Path(args.out)
        (out / f"results_turns_{args.size}.json").write_text(
            json.dumps({**data, "rows": rows}, indent=1)
        )
        text = turns_section(data, rows)
        print(text)
        if args.update_results:
            update_results(text, REPO_ROOT / "benchmarks" / "RESULTS.md", TURNS_BEGIN, TURNS_END)
        return
    rows = summarize(data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results_{args.size}.json").write_text(json.dumps({**data, "rows": rows}, indent=1))
    text = section(data, rows)
    print(text)
    if args.update_results:
        update_results(text, REPO_ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
