"""Section 12 of RESULTS.md: polytrain's Lightning strategies against Lightning's own ddp strategy.

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

from collections.abc import Callable
from typing import Any

from benchmarks.cases import Case, lightning_cases
from benchmarks.workload import WorkloadSpec

TITLE = (
    '### 12. Lightning: Trainer(strategy="ddp") under torchrun vs polytrain\'s strategies '
    "(MLP 784-512-512-10)"
)
NATIVE_KEY = "lightning/native-ddp"
#: The step-ratio goal of every polytrain strategy against Lightning's ddp.
STEP_GOAL = 1.03


def groups(spec: WorkloadSpec) -> list[list[Case]]:
    """One interleaving group: Lightning's ddp under torchrun, then polytrain's strategies."""
    return [lightning_cases(spec)]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _goal(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} ({'met' if value <= limit else 'missed'}, goal <= {limit:g})"


def _keys(section: dict[str, Any]) -> list[str]:
    return [NATIVE_KEY] + [k for k in section if k.startswith("lightning/polytrain-")]


def _summary_lines(
    section: dict[str, Any], aggregate: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[str]:
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
            f"{_goal(_ratio(agg['step_ms'], base['step_ms']), STEP_GOAL)}; interval ratio "
            f"{_fmt(_ratio(agg['interval_ms'], base['interval_ms']), 3)}; launch ratio "
            f"{_fmt(_ratio(agg['launch_s'], base['launch_s']), 2)} incl. ray.init, "
            f"{_fmt(_ratio(agg['launch_excl_ray_init_s'], base['launch_s']), 2)} excl."
        )
    return lines


def _memory_table(
    section: dict[str, Any], aggregate: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[str]:
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
        ratio = (
            "baseline"
            if key == NATIVE_KEY
            else _fmt(_ratio(agg["peak_rss_mb"], base["peak_rss_mb"] if base else None), 3)
        )
        lines.append(
            f"| {entry['label']} | {_fmt(agg['peak_rss_mb'], 0)} "
            f"| {_fmt(agg['delta_rss_mb'], 0)} | {ratio} |"
        )
    return lines


def render(
    section: dict[str, Any],
    meta_line: str,
    time_table: Callable[[dict[str, Any], list[str]], list[str]],
    aggregate: Callable[[dict[str, Any]], dict[str, Any]],
) -> list[str]:
    """The section: launch/step table, ratios against Lightning's ddp, peak memory per rank.

    Args:
        section: the saved results of the section (``out/lightning.json``'s cases).
        meta_line: when, where and with which command it was measured.
        time_table: run.py's launch/step table renderer.
        aggregate: run.py's reduction of a case's runs to medians.
    """
    out = [TITLE, "", meta_line, ""]
    out += time_table(section, _keys(section))
    out += [""] + _summary_lines(section, aggregate) + [""]
    out += _memory_table(section, aggregate)
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
