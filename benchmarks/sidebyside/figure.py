"""Draw the benchmark comparison for the documentation site: docs/assets/benchmarks.png.

The numbers are the MLP rows of ``benchmarks/RESULTS.md`` (sections 1-4: MLP
784-512-512-10, global batch 64, 2 workers on 2 CPU cores, gloo, medians of the
repetitions): each backend's step time under its native launcher and under polytrain.
Update them here after ``make bench`` and run ``python benchmarks/run.py plot``.
The figure is drawn with matplotlib's object-oriented API on the Agg canvas, as
``polytrain compare`` draws ``compare.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: backend label -> (native step ms, polytrain step ms, goal ratio, where it comes from)
STEP_MS = {
    "ddp": (10.50, 10.52, 1.03, "section 1: torchrun vs TorchTrainer(backend='ddp')"),
    "horovod": (13.93, 12.33, 1.03, "section 2: horovodrun --gloo vs backend='horovod'"),
    "fairscale": (10.98, 12.56, 1.05, "section 3: OSS + ShardedDDP, torchrun script"),
    "deepspeed\nZeRO-2": (18.05, 18.66, 1.05, "section 3: deepspeed, torchrun script"),
    "fsdp\n(FSDP2)": (26.85, 29.11, 1.05, "section 3: fully_shard on both sides"),
    "mwms\n(TF)": (19.69, 18.58, 1.03, "section 4: step interval, TF_CONFIG processes"),
}

#: The suite's name on the command line of ``benchmarks/run.py``.
NAME = "plot"
OUT = Path(__file__).resolve().parents[2] / "docs" / "assets" / "benchmarks.png"


def draw(path: Path = OUT) -> Path:
    """Draw the step times and their ratios into ``path`` (a PNG); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(STEP_MS)
    native = [STEP_MS[n][0] for n in names]
    ours = [STEP_MS[n][1] for n in names]
    ratios = [o / n for n, o in zip(native, ours, strict=True)]
    goals = [STEP_MS[n][2] for n in names]

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    step_ax, ratio_ax = fig.subplots(1, 2)
    xs = range(len(names))
    width = 0.38
    step_ax.bar(
        [x - width / 2 for x in xs], native, width, label="native launcher", color="tab:gray"
    )
    step_ax.bar([x + width / 2 for x in xs], ours, width, label="polytrain", color="tab:blue")
    step_ax.set_xticks(list(xs), names)
    step_ax.set(title="Step time, MLP, 2 workers on 2 CPU cores", ylabel="ms per step")
    step_ax.legend()
    bars = ratio_ax.bar(
        names,
        ratios,
        color=["tab:blue" if r <= g else "tab:orange" for r, g in zip(ratios, goals, strict=True)],
    )
    for bar, ratio in zip(bars, ratios, strict=True):
        ratio_ax.annotate(
            f"{ratio:.2f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
        )
    ratio_ax.axhline(1.0, color="black", linewidth=0.8)
    ratio_ax.axhline(
        1.05, color="tab:red", linewidth=0.8, linestyle="--", label="goal 1.05 (sharded)"
    )
    ratio_ax.axhline(1.03, color="tab:green", linewidth=0.8, linestyle=":", label="goal 1.03")
    ratio_ax.set(
        title="polytrain / native (lower is faster)", ylabel="step time ratio", ylim=(0, 1.3)
    )
    ratio_ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path


def main(argv: list[str] | None = None) -> int:
    """Draw the figure (``--out``: somewhere else than the documentation's)."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/run.py {NAME}", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=OUT)
    print(draw(parser.parse_args(argv).out))
    return 0
