"""``run``: the GPU check on this machine, one command, inside a time budget.

    python -m polytrain.tools.gpu_check run [--device cuda|cpu] [--out DIR] [options]

Builds the plan (:mod:`.cases`), starts the worker under torchrun with world size
1 (:mod:`.worker`; NCCL on a GPU, gloo on a CPU), watches its JSON lines, and
writes ``report.json`` and a printed table (:mod:`.report`). A case that crashes
the process (a CUDA error, an NCCL abort) or runs past ``--case-timeout-s`` is
recorded as such and the worker starts again with the cases left; cases that
would end past ``--budget-s`` are skipped and listed. Exit status: 0 when every
case ran and every loss check passed, 1 otherwise, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from polytrain.tools.gpu_check import cases as plan_cases
from polytrain.tools.gpu_check import report as reporting
from polytrain.tools.gpu_check import workload as wl

#: Defaults per device: the model, precisions, compile, the time budget (seconds).
DEFAULTS = {
    "cuda": {"size": "gpt2-124m", "batch": 16, "precisions": "bf16,fp16", "compile": True,
             "budget_s": 480.0, "case_timeout_s": 240.0, "timed_steps": 21},
    "cpu": {"size": "tiny", "batch": 4, "precisions": "fp32,bf16", "compile": False,
            "budget_s": 240.0, "case_timeout_s": 120.0, "timed_steps": 6},
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring and docs/gpu-check.md)."""
    parser = argparse.ArgumentParser(prog="python -m polytrain.tools.gpu_check run")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda when a GPU is visible, else cpu",
    )
    parser.add_argument("--out", default="gpu_check_out", help="folder for report.json and logs")
    parser.add_argument("--size", choices=sorted(wl.SIZES), default=None)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the size's)")
    parser.add_argument("--precisions", default=None, help="comma-separated: fp32, bf16, fp16")
    parser.add_argument(
        "--only",
        default=None,
        help=f"backend cases to run, from {[b[0] for b in plan_cases.BACKENDS]}",
    )
    parser.add_argument("--compile", dest="compile", action="store_true", default=None)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--check-steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=None)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the cases that would end after this many seconds",
    )
    parser.add_argument("--case-timeout-s", type=float, default=None)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak, where the built-in table lacks it",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("check_steps", "timed_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    bad = set(args.precisions) - set(plan_cases.TOLERANCES)
    if bad:
        parser.error(f"--precisions: {sorted(bad)} not in {sorted(plan_cases.TOLERANCES)}")
    names = [b[0] for b in plan_cases.BACKENDS]
    args.only = tuple(x.strip() for x in args.only.split(",")) if args.only else None
    if args.only and set(args.only) - set(names):
        parser.error(f"--only: {sorted(set(args.only) - set(names))} not in {names}")
    return args


def describe_machine(args: argparse.Namespace, model_params: int) -> dict[str, Any]:
    """The report's ``date``, ``device``, ``software`` and ``model`` fields."""
    import torch

    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = props.name
        device = {
            "kind": "cuda",
            "name": name,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "peak_tflops": args.peak_tflops or wl.peak_tflops(name),
            "dist_backend": "nccl",
        }
    else:
        device = {"kind": "cpu", "name": platform.processor() or platform.machine(),
                  "count": os.cpu_count(), "peak_tflops": args.peak_tflops,
                  "dist_backend": "gloo"}  # fmt: skip
    return {
        "date": reporting.today(),
        "device": device,
        "software": _versions(),
        "model": {"name": args.size, "matmul_params": model_params,
                  "seq": args.seq or wl.SIZES[args.size]["seq"]},
        "settings": {"checkpointing": args.checkpointing, "compile": args.compile,
                     "budget_s": args.budget_s, "case_timeout_s": args.case_timeout_s},
    }  # fmt: skip


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}  # fmt: skip
    if torch.cuda.is_available():
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    for dist in ("polytrain", "transformers", "deepspeed", "fairscale", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            pass  # a line cut by a crash mid-write
    return lines


def _start_worker(plan_path: Path, lines_path: Path, log_path: Path) -> subprocess.Popen:
    """The worker under torchrun (world size 1), in a process session of its own."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "1", "-m", "polytrain.tools.gpu_check", "worker",
               "--plan", str(plan_path), "--out", str(lines_path)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("a") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    """End the worker and everything torchrun started (its process session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Runner:
    """Runs the plan's cases through as many worker processes as crashes and hangs need."""

    def __init__(self, args: argparse.Namespace, workload: wl.Workload, case_list: list) -> None:
        self.args, self.workload, self.cases = args, workload, case_list
        self.out = Path(args.out)
        self.results: dict[str, dict[str, Any]] = {}
        self.began = time.monotonic()
        self.attempt = 0

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.began

    def _plain_step_s(self) -> float | None:
        steps = [r["step_s"] for r in self.results.values() if r.get("step_s")]
        return max(steps) if steps else None

    def _affordable(self, remaining: list) -> list:
        """The leading cases of ``remaining`` that fit in the budget; the others are skipped."""
        spent, keep = self.elapsed(), []
        for case in remaining:
            spent += plan_cases.estimate_case_s(case, self.args.device, self._plain_step_s(),
                                                self.workload.steps)  # fmt: skip
            if spent > self.args.budget_s:
                break
            keep.append(case)
        for case in remaining[len(keep) :]:
            self.results[case.name] = {"status": "skipped", "error": "skipped: time budget "
                                       f"(--budget-s {self.args.budget_s:g}) spent"}  # fmt: skip
        return keep

    def run(self) -> None:
        """Every case once: ok, failed, crashed, timeout or skipped."""
        remaining = list(self.cases)
        while remaining:
            remaining = self._affordable(remaining)
            if not remaining:
                return
            remaining = self._one_worker(remaining)

    def _one_worker(self, todo: list) -> list:
        """Run ``todo`` in one worker; return the cases it did not get to."""
        self.attempt += 1
        plan_path = self.out / f"plan-{self.attempt}.json"
        lines_path = self.out / f"cases-{self.attempt}.jsonl"
        log_path = self.out / "worker.log"
        plan_path.write_text(json.dumps({"device": self.args.device, "workload": vars(self.workload),
                                         "cases": [c.to_dict() for c in todo]}))  # fmt: skip
        proc = _start_worker(plan_path, lines_path, log_path)
        current, since, timed_out = None, time.monotonic(), False
        while proc.poll() is None:
            time.sleep(0.5)
            lines = _read_lines(lines_path)
            if lines and lines[-1]["event"] == "start" and lines[-1]["case"] != current:
                current, since = lines[-1]["case"], time.monotonic()
            elif lines and lines[-1]["event"] == "result":
                current = None
            if current is not None and time.monotonic() - since > self.args.case_timeout_s:
                timed_out = True
                break
        _stop(proc)
        done = {}
        for line in _read_lines(lines_path):
            if line["event"] == "result":
                done[line["case"]] = {k: v for k, v in line.items() if k not in ("event", "case")}
        self.results.update(done)
        started = [line["case"] for line in _read_lines(lines_path) if line["event"] == "start"]
        cut = next((name for name in started if name not in done), None)
        if cut is not None:
            tail = log_path.read_text()[-3000:] if log_path.exists() else ""
            self.results[cut] = {
                "status": "timeout" if timed_out else "crashed",
                "error": (f"timeout: still running after --case-timeout-s "
                          f"{self.args.case_timeout_s:g}" if timed_out else
                          f"crashed: the worker exited with {proc.returncode}"),
                "log_tail": tail,
            }  # fmt: skip
        elif len(done) < len(todo) and not started:
            tail = log_path.read_text()[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"the worker exited with {proc.returncode} before its first "
                               f"case; its log ({log_path}) ends:\n{tail}")  # fmt: skip
        return [c for c in todo if c.name not in self.results]


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module's docstring)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = wl.Workload(size=args.size, batch=args.batch, check_steps=args.check_steps,
                           warmup_steps=args.warmup_steps, timed_steps=args.timed_steps, seq=args.seq)  # fmt: skip
    case_list = plan_cases.plan(args.precisions, args.checkpointing, args.compile, args.only)
    params = wl.count_params(_meta_model(workload))
    meta = describe_machine(args, params)
    runner = Runner(args, workload, case_list)
    print(f"GPU check: {len(case_list)} cases on {meta['device']['name']} ({args.device}), "
          f"budget {args.budget_s:g} s; worker log: {out / 'worker.log'}", flush=True)  # fmt: skip
    runner.run()
    meta["elapsed_s"] = runner.elapsed()
    report = reporting.build_report(meta, workload, case_list, runner.results)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(reporting.table(report))
    passed = reporting.verdict(report)
    print(f"\n{'PASSED' if passed else 'FAILED'} in {meta['elapsed_s']:.0f} s; report: "
          f"{out / 'report.json'}")  # fmt: skip
    return 0 if passed else 1


def _meta_model(workload: wl.Workload) -> Any:
    """The model on the meta device: its parameter count without memory or time."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(wl.gpt2_config(workload))
