"""GPT-2 benchmarks against the native launchers (issue 26, items 4 and 5).

Two suites, each run in one invocation with the runners interleaved (native,
polytrain, native, polytrain, ...) and reported as medians and ratios, with the
same machinery as the side-by-side suite (:mod:`benchmarks.harness`):

* ``--suite memory``: GPT-2 medium (354.8M parameters) on 2 workers: peak RSS per
  rank and the set-up peak for ddp, fsdp (FSDP2 FULL_SHARD by block), DeepSpeed
  ZeRO-2 and ZeRO-3 and fairscale, each next to its torchrun script and its ZeRO
  formula (RESULTS.md section 9).
* ``--suite speed``: GPT-2 with 6 layers, d=512, sequence 256: step time and
  tokens/s of ddp, fairscale, fsdp, DeepSpeed ZeRO-2 (torchrun) and horovod
  (horovodrun) against polytrain (RESULTS.md section 10).

Usage::

    python benchmarks/run.py lm --suite memory            # 3 reps, 3 steps (~45-60 min on 2 cores)
    python benchmarks/run.py lm --suite memory --reps 1   # one of each (~15-20 min)
    python benchmarks/run.py lm --suite speed             # 3 reps, 10 steps (~35-45 min)
    python benchmarks/run.py lm --suite both --quick      # smoke: tiny GPT-2, 1 rep (~8 min)
    python benchmarks/run.py lm --suite speed --only ddp,fsdp --reps 5
    python benchmarks/run.py lm --render-only             # rebuild sections 9-10 from out/

Raw results go to ``benchmarks/out/lm-memory.json`` / ``lm-speed.json`` (each run
with its load average before it; each section with the load at its start and end)
and the tables into RESULTS.md; the README's short table is written to
``benchmarks/out/lm-readme.md``. ``--quick`` keeps everything under
``benchmarks/out/quick/`` (its tables in ``out/quick/lm-results.md``) and leaves
RESULTS.md alone: smoke figures are not results.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from benchmarks import results
from benchmarks.harness.cases import Case, native_command, torch_cases
from benchmarks.harness.runner import OUT, load_saved, run_sections
from benchmarks.lm import tables
from benchmarks.workloads.gpt2 import LMSpec

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "lm"
QUICK_OUT = OUT / "quick"
#: Set-up of the 355M model (HF init, broadcast, sharding) plus its steps: minutes per run.
MEMORY_TIMEOUT_S = 1800.0
SPEED_TIMEOUT_S = 900.0


def build_sections(args: argparse.Namespace) -> dict[str, list[list[Case]]]:
    """The selected suites, each one interleaving group of native and polytrain cases."""
    size = "tiny" if args.quick else None
    memory = LMSpec(size=size or "memory", steps=args.memory_steps, warmup=1)
    speed = LMSpec(size=size or "speed", steps=args.speed_steps, warmup=args.speed_warmup)
    sections: dict[str, list[list[Case]]] = {}
    if args.suite in ("memory", "both"):
        sections[tables.MEMORY] = [
            [
                c
                for tag in tables.MEMORY_TAGS
                for c in torch_cases(tag, memory, tables.MEMORY, MEMORY_TIMEOUT_S)
            ]
        ]
        # Not a comparison: what the native side reaches when ranks > 0 never hold the model.
        label, argv, requires = native_command("fsdp", memory.to_json())
        sections[tables.MEMORY][0].append(
            Case(
                tables.META_KEY,
                label.replace("FSDP script", "FSDP2 script, ranks > 0 built on the meta device"),
                "fsdp",
                "native",
                [(argv + ["--meta-init"], {})],
                memory,
                requires,
                MEMORY_TIMEOUT_S,
            )
        )
    if args.suite in ("speed", "both"):
        sections[tables.SPEED] = [
            [
                c
                for tag in tables.SPEED_TAGS
                for c in torch_cases(tag, speed, tables.SPEED, SPEED_TIMEOUT_S)
            ]
        ]
    return sections


def write_outputs(out_dir: Path, quick: bool) -> str:
    """Render the saved results: RESULTS.md (not for a smoke run) and the README table."""
    saved = load_saved(out_dir)
    text = "\n".join(tables.render(saved))
    if quick:
        (out_dir / "lm-results.md").write_text(text)
    else:
        results.write_results_md(load_saved())
    (out_dir / "lm-readme.md").write_text("\n".join(tables.readme_table(saved)) + "\n")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--suite", choices=("memory", "speed", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="tiny GPT-2, 1 rep, out/quick/")
    all_tags = sorted(set(tables.MEMORY_TAGS) | set(tables.SPEED_TAGS))
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {all_tags}")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (3; --quick: 1)")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--speed-steps", type=int, default=None, help="10; --quick: 4")
    parser.add_argument("--speed-warmup", type=int, default=None, help="3; --quick: 1")
    parser.add_argument("--render-only", action="store_true", help="rebuild the tables from out/")
    args = parser.parse_args(argv)
    args.tags = {t.strip() for t in (args.only or ",".join(all_tags)).split(",") if t.strip()}
    if args.tags - set(all_tags):
        parser.error(f"--only got {sorted(args.tags - set(all_tags))}; choose from {all_tags}")
    args.reps = args.reps or (1 if args.quick else 3)
    args.speed_steps = args.speed_steps or (4 if args.quick else 10)
    args.speed_warmup = args.speed_warmup or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the selected suites, save the raw results and render the tables."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out_dir = QUICK_OUT if args.quick else OUT
    command = " ".join(["python benchmarks/run.py", NAME, *argv])
    if not args.render_only:
        run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        print(f"load average at start: {os.getloadavg()}", flush=True)
        run_sections(build_sections(args), args.tags, args.reps, run_id, command, out_dir)
        print(f"load average at end: {os.getloadavg()}", flush=True)
    print(write_outputs(out_dir, args.quick))
    return 0
