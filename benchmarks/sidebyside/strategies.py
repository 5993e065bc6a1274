"""RESULTS.md section 12: polytrain's Lightning strategies against Lightning's own ddp strategy.

One interleaving group, every case training the same LightningModule
(:class:`benchmarks.native.lightning_native.WorkloadModule`: the MLP workload of
the other sections) with the same Trainer options:

1. ``torchrun --nproc_per_node=2`` + ``pl.Trainer(strategy="ddp")`` (Lightning
   detects torchrun's environment): the baseline;
2. ``pl.Trainer(strategy=RayStrategy(num_workers=2))`` from one driver process,
   which starts a local Ray instance (timed on its own);
3. the variants ``RayHorovodStrategy``, ``RayShardedStrategy`` (fairscale) and
   ``RayDeepSpeedStrategy`` (ZeRO-2), each skipped where its library is missing.

A timing callback records the step (batch start to the end of the optimizer
step), the interval (batch end to batch end), the first step's wall time and the
peak RSS of every rank. Each polytrain run's ratios are against the torchrun run
of the same invocation. The goal (issue 30) is a step ratio <= 1.03; the launch
ratio is reported. The variants run another algorithm than DDP (Horovod's ring,
optimizer-state sharding, a DeepSpeed engine): their ratio against Lightning's
ddp measures the strategy and the algorithm together, while sections 2 and 3
compare each backend with its own native launcher.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.cases import Case, python_command, torchrun_command
from benchmarks.harness.tables import aggregate, fmt, goal, meta_line, ratio, render_time_table
from benchmarks.workloads.mlp import WorkloadSpec

#: The section's name in the suite's ``--only`` and in ``benchmarks/out/<name>.json``.
SECTION = "lightning"

TITLE = (
    '### 12. Lightning: Trainer(strategy="ddp") under torchrun vs polytrain\'s strategies '
    "(MLP 784-512-512-10)"
)
NATIVE_KEY = "lightning/native-ddp"
#: The step-ratio goal of every polytrain strategy against Lightning's ddp.
STEP_GOAL = 1.03


#: polytrain's Lightning strategies in this section: (``--strategy`` of
#: drivers/polytrain_lightning.py, label, modules the variant needs).
VARIANTS = (
    ("ddp", "polytrain RayStrategy(num_workers=2) (ddp)", ()),
    ("horovod", "polytrain RayHorovodStrategy(num_workers=2)", ("horovod",)),
    ("sharded", "polytrain RayShardedStrategy(num_workers=2) (fairscale)", ("fairscale",)),
    ("deepspeed", "polytrain RayDeepSpeedStrategy(num_workers=2) (ZeRO-2)", ("deepspeed",)),
)


def strategy_cases(spec: WorkloadSpec, prefix: str = "lightning") -> list[Case]:
    """Lightning's ``strategy="ddp"`` under torchrun, then polytrain's strategies, on one module.

    Every case trains :class:`benchmarks.native.lightning_native.WorkloadModule` with
    the same Trainer options; each polytrain case is compared with the torchrun run.
    A DeepSpeed launch may compile DeepSpeed's communication extension first (once per
    machine), hence its longer timeout.
    """
    s = spec.to_json()
    native_key = f"{prefix}/native-ddp"
    cases = [
        Case(
            native_key,
            'torchrun + Lightning Trainer(strategy="ddp")',
            "lightning",
            "native",
            [(torchrun_command("native/lightning_native.py", "--spec", s), {})],
            spec,
            ("pytorch_lightning",),
        )
    ]
    for variant, label, requires in VARIANTS:
        argv = python_command("drivers/polytrain_lightning.py", "--strategy", variant, "--spec", s)
        cases.append(
            Case(
                f"{prefix}/polytrain-{variant}",
                label,
                "lightning",
                "polytrain",
                [(argv, {})],
                spec,
                ("pytorch_lightning", *requires),
                600.0 if variant == "deepspeed" else 300.0,
                baseline=native_key,
            )
        )
    return cases


def groups(spec: WorkloadSpec) -> list[list[Case]]:
    """One interleaving group: Lightning's ddp under torchrun, then polytrain's strategies."""
    return [strategy_cases(spec)]


def _keys(section: dict[str, Any]) -> list[str]:
    return [NATIVE_KEY] + [k for k in section if k.startswith("lightning/polytrain-")]


def _summary_lines(section: dict[str, Any]) -> list[str]:
    """Per polytrain strategy: step ratio against the goal, interval and launch ratios."""
    native = section.get(NATIVE_KEY)
    if not native or not aggregate(native)["n"]:
        return []
    base = aggregate(native)
    lines = []
    for key in _keys(section)[1:]:
        entry = section[key]
        agg = aggregate(entry)
        if not agg["n"]:
            continue
        lines.append(
            f"- {entry['label']}: step ratio "
            f"{goal(ratio(agg['step_ms'], base['step_ms']), STEP_GOAL)}; interval ratio "
            f"{fmt(ratio(agg['interval_ms'], base['interval_ms']), 3)}; launch ratio "
            f"{fmt(ratio(agg['launch_s'], base['launch_s']), 2)} incl. ray.init, "
            f"{fmt(ratio(agg['launch_excl_ray_init_s'], base['launch_s']), 2)} excl."
        )
    return lines


def _memory_table(section: dict[str, Any]) -> list[str]:
    """Peak RSS per rank (the worst rank, median over the reps) and its growth."""
    lines = [
        "| Runner | Peak RSS/rank (MiB) | Growth/rank from before the model (MiB) "
        "| Peak RSS ratio |",
        "|---|---|---|---|",
    ]
    native = section.get(NATIVE_KEY)
    base = aggregate(native) if native else None
    for key in _keys(section):
        entry = section.get(key)
        if entry is None:
            continue
        agg = aggregate(entry)
        if not agg["n"]:
            continue
        peak_ratio = (
            "baseline"
            if key == NATIVE_KEY
            else fmt(ratio(agg["peak_rss_mb"], base["peak_rss_mb"] if base else None), 3)
        )
        lines.append(
            f"| {entry['label']} | {fmt(agg['peak_rss_mb'], 0)} "
            f"| {fmt(agg['delta_rss_mb'], 0)} | {peak_ratio} |"
        )
    return lines


def render(all_results: dict[str, dict[str, Any]]) -> list[str]:
    """The section, if measured: launch/step table, ratios against Lightning's ddp, peak memory per rank."""
    section = all_results.get(SECTION)
    if not section:
        return []
    out = [TITLE, "", meta_line(section), ""]
    out += render_time_table(section, _keys(section))
    out += [""] + _summary_lines(section) + [""]
    out += _memory_table(section)
    out += [
        "",
        "(Every runner trains the same LightningModule with the same Trainer options; the "
        "step runs from `on_train_batch_start` to the end of the optimizer step, the "
        "interval from one `on_train_batch_end` to the next. The polytrain runs' launch "
        "includes starting a local Ray instance (the ray.init column), which a session on a "
        "running cluster pays once. The Horovod, sharded and DeepSpeed strategies run "
        "another algorithm than DDP: their ratios against Lightning's ddp include it; "
        "sections 2 and 3 compare each backend with its own native launcher.)",
        "",
    ]
    return out
