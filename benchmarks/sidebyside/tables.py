"""RESULTS.md sections 1-4: every backend against its native launcher (and Ray Train) on the MLP.

1. DDP: torchrun vs polytrain vs Ray Train; 2. Horovod: horovodrun vs polytrain;
3. the sharded backends against their torchrun scripts, step time and memory next to
the ZeRO formulas, on the MLP and on a model whose optimizer state dominates;
4. TensorFlow MultiWorkerMirroredStrategy: two ``TF_CONFIG`` processes vs TFTrainer
and Ray Train.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.tables import (
    aggregate,
    fmt,
    goal,
    meta_line,
    ratio,
    render_time_table,
    skip_note,
)
from benchmarks.workloads.mlp import NUM_WORKERS, WorkloadSpec


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
        skipped = skip_note(entry) or skip_note(native)
        if skipped:
            lines.append(f"| {tag} | {skipped} |||||||||")
            continue
        a, b = aggregate(native), aggregate(entry)
        text, formula = zero_formula_mb(tag, p)
        lines.append(
            f"| {tag} | {fmt(a['step_ms'], 2)} | {fmt(b['step_ms'], 2)} "
            f"| {goal(ratio(b['step_ms'], a['step_ms']), 1.05)} "
            f"| {fmt(a['launch_s'])} | {fmt(b['launch_excl_ray_init_s'])} "
            f"| {fmt(a['peak_rss_mb'], 0)} / {fmt(b['peak_rss_mb'], 0)} "
            f"| {fmt(a['delta_rss_mb'], 0)} / {fmt(b['delta_rss_mb'], 0)} "
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
    if not entry or skip_note(entry) or entry.get("baseline") not in section:
        return []
    agg, base = aggregate(entry), aggregate(section[entry["baseline"]])
    interval_r = ratio(agg["interval_ms"], base["interval_ms"])
    if interval_only:
        lines = [f"- {entry['label']}: step interval ratio {goal(interval_r, step_goal)}."]
    else:
        lines = [
            f"- {entry['label']}: step ratio "
            f"{goal(ratio(agg['step_ms'], base['step_ms']), step_goal)}; "
            f"interval ratio {fmt(interval_r, 3)}."
        ]
    if launch_goal is not None:
        lines.append(
            f"- {entry['label']}: launch ratio incl. ray.init "
            f"{goal(ratio(agg['launch_s'], base['launch_s']), launch_goal)}; excl. ray.init "
            f"{goal(ratio(agg['launch_excl_ray_init_s'], base['launch_s']), launch_goal)}."
        )
    return lines


def render(all_results: dict[str, dict[str, Any]]) -> list[str]:
    """Sections 1-4, those present in ``all_results``."""
    out = []
    core = all_results.get("core")
    if core:
        out += ["### 1. DDP: torchrun vs polytrain vs Ray Train (MLP 784-512-512-10)", ""]
        out += [meta_line(core), ""]
        out += render_time_table(
            core, ["core/native-ddp", "core/polytrain-ddp", "core/raytrain-torch"]
        )
        out += [""] + _goals(core, "core/polytrain-ddp", 1.03, 1.5) + [""]
    hvd = all_results.get("horovod")
    if hvd:
        out += ["### 2. Horovod: horovodrun vs polytrain (MLP 784-512-512-10)", ""]
        out += [meta_line(hvd), ""]
        out += render_time_table(hvd, ["horovod/native-horovod", "horovod/polytrain-horovod"])
        out += [""] + _goals(hvd, "horovod/polytrain-horovod", 1.03, 1.5)
        if core and "core/polytrain-ddp" in core and "horovod/polytrain-horovod" in hvd:
            a = aggregate(hvd["horovod/polytrain-horovod"])
            b = aggregate(core["core/polytrain-ddp"])
            out.append(
                f"- Horovod vs DDP under polytrain: step {fmt(ratio(a['step_ms'], b['step_ms']), 3)}x, "
                f"interval {fmt(ratio(a['interval_ms'], b['interval_ms']), 3)}x "
                f"(same invocation, different interleaving groups)."
            )
        out.append("")
    sharded = all_results.get("sharded")
    if sharded:
        out += ["### 3. Sharded backends: native torchrun scripts vs polytrain", ""]
        out += [meta_line(sharded), ""]
        out += render_sharded(sharded, "sharded-mlp", "MLP 784-512-512-10")
        out += render_sharded(sharded, "sharded-big", "Large model (optimizer state dominates)")
    tf = all_results.get("tf")
    if tf:
        out += ["### 4. TensorFlow MultiWorkerMirroredStrategy (Keras MLP 784-512-512-10)", ""]
        out += [meta_line(tf), ""]
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
    return out
