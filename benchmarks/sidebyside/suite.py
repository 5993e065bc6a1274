"""The side-by-side suite: polytrain against the native launchers and Ray Train.

``make bench`` runs it (``python benchmarks/run.py sidebyside``). Every comparison
runs in this one invocation, interleaved (A, B, A, B, ...) so that a change in
machine load hits both sides alike; each number is the median over the
repetitions and comparisons are reported as ratios. Raw results go to
``benchmarks/out/<section>.json``; the tables in ``benchmarks/RESULTS.md`` are
regenerated from them (:mod:`benchmarks.results`).

Usage::

    python benchmarks/run.py sidebyside                 # everything, 3 repetitions (~25 min on 2 cores)
    python benchmarks/run.py sidebyside --quick         # a short smoke run (1 repetition, few steps, no Ray Train)
    python benchmarks/run.py sidebyside --only ddp,horovod --reps 5
    python benchmarks/run.py sidebyside --only warm     # start-up: cold path per phase, warm workers

``--only`` takes: ddp, raytrain, horovod, fairscale, deepspeed, fsdp, tf, warm
(see :mod:`benchmarks.startup.warm`), launch (:mod:`benchmarks.sidebyside.unmodified_script`),
lightning (:mod:`benchmarks.sidebyside.strategies`). The GPT-2 suites (memory per
rank and speed on a transformer) are :mod:`benchmarks.lm.suite`; their tables are
part of RESULTS.md too, so ``--render-only`` rebuilds them as well.

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
import datetime
import functools
import json
import os
import sys

from benchmarks import results
from benchmarks.harness.cases import Case, Command, free_ports, python_command, torch_cases
from benchmarks.harness.runner import OUT, load_saved, run_sections
from benchmarks.sidebyside import strategies, unmodified_script
from benchmarks.startup import warm
from benchmarks.workloads.mlp import NUM_WORKERS, WorkloadSpec

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "sidebyside"
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
TF_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def tf_native_commands(spec_json: str) -> list[Command]:
    """The two TF processes with a hand-written ``TF_CONFIG`` each (ports picked at launch)."""
    ports = free_ports(NUM_WORKERS)
    workers = [f"127.0.0.1:{p}" for p in ports]
    commands = []
    for index in range(NUM_WORKERS):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        commands.append(
            (
                python_command("native/tf_native.py", "--spec", spec_json),
                {"TF_CONFIG": json.dumps(tf_config), **TF_ENV},
            )
        )
    return commands


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
        [(python_command("drivers/raytrain_torch.py", "--spec", s), {})],
        core,
        ("ray.train",),
        baseline="core/native-ddp",
    )
    tf_cases = [
        Case(
            "tf/native-tf",
            "2 processes + hand-written TF_CONFIG",
            "tf",
            "native",
            [],
            core,
            ("tensorflow", "tf_keras"),
            commands_at_launch=functools.partial(tf_native_commands, s),
        ),
        Case(
            "tf/polytrain-tf",
            'polytrain TFTrainer(backend="mwms")',
            "tf",
            "polytrain",
            [(python_command("drivers/polytrain_tf.py", "--spec", s), TF_ENV)],
            core,
            ("tensorflow", "tf_keras"),
            baseline="tf/native-tf",
        ),
        Case(
            "tf/raytrain-tf",
            "Ray Train TensorflowTrainer (ScalingConfig(num_workers=2))",
            "raytrain",
            "raytrain",
            [(python_command("drivers/raytrain_tf.py", "--spec", s), TF_ENV)],
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
        warm.SECTION: warm.groups(args.warm_steps),
        unmodified_script.SECTION: unmodified_script.groups(core),
        strategies.SECTION: strategies.groups(core),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring), with the defaults filled in."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.split("\n\n")[0]
    )
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
    args.tags = {t.strip() for t in (args.only or ",".join(default_tags)).split(",") if t.strip()}
    unknown = args.tags - set(TAGS)
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
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, save the raw results and regenerate RESULTS.md."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = " ".join(["python benchmarks/run.py", NAME, *argv])
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        print(f"load average at start: {os.getloadavg()}", flush=True)
        run_sections(build_sections(args), args.tags, args.reps, run_id, command)
        print(f"load average at end: {os.getloadavg()}", flush=True)
    results.write_results_md(load_saved())
    print(results.render(load_saved()))
    return 0
