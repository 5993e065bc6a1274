"""Mesh layouts on 4 workers: polytrain vs a native torchrun script, memory against the formulas.

For each layout (FSDP 4, HSDP 2x2, TP 2 x FSDP 2) and each repetition, the native
script (native_mesh.py under ``torchrun --nproc_per_node=4``) and polytrain
(polytrain_mesh.py) run back to back, their order alternating between
repetitions, so a change in the machine's load hits both. Reported: the median
step time of each, their ratio, each rank's held bytes (parameters and AdamW
state, counted on the real tensors) against :func:`workload.formula_bytes`, and
the peak resident memory of the ranks; the 1-minute load average before every run.

Usage: python benchmarks/parallel/bench.py [--size 350m|tiny] [--reps 3] [--steps 4] [--warmup 2]
       [--layouts fsdp4,hsdp2x2,tp2xfsdp2] [--out benchmarks/out/parallel] [--update-results]
``--update-results`` writes the section into benchmarks/RESULTS.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.parallel import workload  # noqa: E402

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- parallel:begin -->", "<!-- parallel:end -->"
#: A private, short directory for the Ray instances of the polytrain runs (socket paths).
RAY_TMPDIR = tempfile.mkdtemp(prefix="ptparray", dir="/tmp")


def _env() -> dict[str, str]:
    # polytrain_mesh.py starts its own Ray: never another cluster running on this host.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = RAY_TMPDIR
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(command: list[str], timeout_s: float) -> None:
    """Run ``command``; on failure, raise with the tail of its output."""
    proc = subprocess.run(
        command, env=_env(), timeout=timeout_s, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(
            f"{' '.join(command[:4])} ... exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-6000:]}"
        )


def run_native(spec: workload.Spec, timeout_s: float) -> dict:
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


def run_polytrain(spec: workload.Spec, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="ptpar-") as out:
        command = [sys.executable, str(HERE / "polytrain_mesh.py"), "--spec", spec.to_json()]
        _run([*command, "--out", out], timeout_s)
        result = json.loads((Path(out) / "polytrain.json").read_text())
    workers = sorted(result["workers"], key=lambda w: w["rank"])
    return {
        "step_s": result["step_s"],
        "worker_loop_step_s": result["worker_loop_step_s"],
        "held": [w["held"] for w in workers],
        "peak_rss_mb": [w["peak_rss_mb"] for w in workers],
    }


RUNNERS = {"native": run_native, "polytrain": run_polytrain}


def run_once_more_on_a_crash(runner: str, spec: workload.Spec, timeout_s: float) -> dict:
    """``RUNNERS[runner]``; a run that dies (a rank's crash) is run once more, and says so.

    On 4 CPU processes over 2 cores a rank of the native TP run died once (a SIGSEGV
    inside gloo's TCP transport) and took an hour's suite with it; the failure's line is
    kept with the result (``retried``), and a second failure is raised.
    """
    try:
        return RUNNERS[runner](spec, timeout_s)
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        cause = next((line for line in lines if "SIGSEGV" in line or "Error" in line), lines[-1])
        print(f"[parallel] {runner} {spec.layout} failed, running it once more: {cause}")
        return {**RUNNERS[runner](spec, timeout_s), "retried": cause.strip()[:300]}


def measure(args: argparse.Namespace) -> dict:
    data = {
        "size": args.size,
        "params": workload.num_params(args.size),
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": [],
    }
    partial = Path(args.out) / f"partial_{args.size}.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        for layout in args.layouts:
            order = ["native", "polytrain"] if rep % 2 == 0 else ["polytrain", "native"]
            for runner in order:
                spec = workload.Spec(args.size, layout, steps=args.steps, warmup=args.warmup)
                load = os.getloadavg()[0]
                start = time.monotonic()
                result = run_once_more_on_a_crash(runner, spec, args.timeout_s)
                data["runs"].append(
                    {
                        "rep": rep, "layout": layout, "runner": runner, "load_1m": round(load, 2),
                        "wall_s": round(time.monotonic() - start, 1), **result,
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
        formula = workload.formula_bytes(data["size"], layout)
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
        f"AdamW, 4 workers on gloo/CPU, one thread each. `benchmarks/parallel/bench.py`: "
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
        "(gradients are laid out like the parameters); formula: 3 x 4 bytes x P / (dp_shard x tp).",
        END,
    ]
    return "\n".join(lines)


def update_results(text: str, path: Path) -> None:
    current = path.read_text() if path.exists() else ""
    if BEGIN in current and END in current:
        head, rest = current.split(BEGIN, 1)
        current = head + text + rest.split(END, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(current)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="350m", choices=sorted(workload.SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=workload.Spec.steps)
    parser.add_argument("--warmup", type=int, default=workload.Spec.warmup)
    parser.add_argument("--layouts", default=",".join(workload.LAYOUTS))
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "out" / "parallel"))
    parser.add_argument("--update-results", action="store_true")
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    try:
        data = measure(args)
    finally:
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
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
