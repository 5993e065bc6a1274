"""Run the same job on several backends and compare speed, memory and accuracy.

From Python::

    from polytrain.compare import compare_backends
    results = compare_backends("examples/configs/ddp.yaml", ["ddp", "horovod"], epochs=3)

or with your own creators (the TorchTrainer keyword arguments)::

    results = compare_backends(
        {"model_creator": ..., "data_creator": ..., "optimizer_creator": ...,
         "loss_creator": torch.nn.CrossEntropyLoss, "config": {...}, "num_workers": 2},
        backends=None,  # every installed torch backend
        epochs=3,
        out_dir="runs/compare",
    )

Each backend runs sequentially and is shut down before the next starts. A
backend whose package is not installed is reported as skipped (with the command
that installs it); one that fails is reported with its error, and the others
still run. The results go to ``compare.csv``, ``results.json`` and
``compare.png`` (loss curves and a throughput bar chart) in ``out_dir``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polytrain.backends.registry import available_backends, get_spec
from polytrain.compat.imports import MissingDependencyError, install_hint, module_available

__all__ = ["BackendResult", "compare_backends", "default_run_dir", "format_table", "write_results"]

OK, SKIPPED, FAILED = "ok", "skipped", "failed"

CSV_COLUMNS = (
    "backend",
    "status",
    "epochs",
    "epoch_time_s",
    "samples_per_s",
    "final_loss",
    "val_loss",
    "val_accuracy",
    "peak_memory_mb",
    "startup_s",
    "losses",
    "reason",
)


@dataclass
class BackendResult:
    """What one backend did on the comparison job.

    Attributes:
        backend: the backend name as requested.
        status: "ok", "skipped" (not installed) or "failed" (raised; see ``reason``).
        reason: why it was skipped or failed (with the install command where one helps).
        losses: mean training loss of each epoch.
        epoch_times_s: wall time of each epoch (slowest worker).
        samples_per_s: throughput of each epoch, all workers together.
        val_loss: validation loss after the last epoch (None without validation data).
        val_accuracy: validation accuracy after the last epoch.
        peak_memory_mb: the largest peak memory of one worker over all epochs.
        startup_s: seconds to start the workers and build the model on them.
    """

    backend: str
    status: str = OK
    reason: str = ""
    losses: list[float] = field(default_factory=list)
    epoch_times_s: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    val_loss: float | None = None
    val_accuracy: float | None = None
    peak_memory_mb: float | None = None
    startup_s: float | None = None

    @property
    def epochs(self) -> int:
        """Epochs completed."""
        return len(self.losses)

    @property
    def final_loss(self) -> float | None:
        """Training loss of the last epoch."""
        return self.losses[-1] if self.losses else None

    @property
    def epoch_time_s(self) -> float | None:
        """Steady-state epoch time: the mean over the epochs after the first, when there are several.

        The first epoch also pays one-off costs (lazy imports, allocator warm-up,
        DeepSpeed's extension build) that say little about the backend's speed.
        """
        times = self.epoch_times_s[1:] or self.epoch_times_s
        return statistics.fmean(times) if times else None

    @property
    def throughput(self) -> float | None:
        """Steady-state samples/s, over the same epochs as :attr:`epoch_time_s`."""
        rates = self.samples_per_s[1:] or self.samples_per_s
        return statistics.fmean(rates) if rates else None

    def row(self) -> dict[str, Any]:
        """One CSV row (see :data:`CSV_COLUMNS`)."""
        return {
            "backend": self.backend,
            "status": self.status,
            "epochs": self.epochs,
            "epoch_time_s": _round(self.epoch_time_s, 4),
            "samples_per_s": _round(self.throughput, 1),
            "final_loss": _round(self.final_loss, 5),
            "val_loss": _round(self.val_loss, 5),
            "val_accuracy": _round(self.val_accuracy, 4),
            "peak_memory_mb": _round(self.peak_memory_mb, 1),
            "startup_s": _round(self.startup_s, 2),
            "losses": ";".join(f"{x:.5f}" for x in self.losses),
            "reason": self.reason,
        }


def _round(value: float | None, digits: int) -> float | str:
    return "" if value is None else round(float(value), digits)


def default_run_dir(prefix: str, root: str | os.PathLike = "polytrain_runs") -> Path:
    """A new directory name ``root/<prefix>-<YYYYmmdd-HHMMSS>`` (suffixed if taken)."""
    base = Path(root) / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def has_validation_data(operator: Any) -> bool:
    """Worker side: whether this worker's operator has a validation loader."""
    return getattr(operator, "val_loader", None) is not None


def _can_validate(trainer: Any) -> bool:
    apply = getattr(trainer, "apply_all_operators", None)
    if apply is None:
        return True
    return all(apply(has_validation_data))


def _skip_reason(name: str) -> str | None:
    spec = get_spec(name)
    missing = [m for m in spec.requires if not module_available(m)]
    if not missing:
        return None
    return f"not installed ({', '.join(missing)} missing): {install_hint(missing[0])}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _make_builder(run: Any) -> tuple[str, Callable[[str], Any], int, int | None]:
    """(framework, backend name -> trainer, default epochs, default num_steps)."""
    from polytrain.trainer_api.run_config import RunConfig, load_config

    if isinstance(run, (str, os.PathLike)):
        run = load_config(run)
    if isinstance(run, RunConfig):
        config = run

        def build(name: str) -> Any:
            return config.with_overrides({"backend": name, "use_tqdm": False}).build_trainer()

        return config.trainer, build, config.epochs, config.num_steps
    if isinstance(run, Mapping):
        kwargs = dict(run)
        kwargs.pop("backend", None)
        kwargs.pop("backend_config", None)
        trainer_cls = kwargs.pop("trainer_cls", None)
        if trainer_cls is None:
            from polytrain.trainer_api.torch_trainer import TorchTrainer

            trainer_cls = TorchTrainer

        def build_from_kwargs(name: str) -> Any:
            return trainer_cls(**kwargs, backend=name)

        return getattr(trainer_cls, "framework", "torch"), build_from_kwargs, 1, None
    raise TypeError(
        f"compare_backends takes a RunConfig, the path of a YAML run config, or a dict of "
        f"trainer keyword arguments (model_creator=..., ...); got {type(run).__name__}: {run!r}."
    )


def _run_one(
    name: str,
    build: Callable[[str], Any],
    epochs: int,
    num_steps: int | None,
    log: Callable[[str], None],
) -> BackendResult:
    result = BackendResult(backend=name)
    reason = _skip_reason(name)
    if reason:
        result.status, result.reason = SKIPPED, reason
        log(f"  {name}: skipped, {reason}")
        return result
    start = time.perf_counter()
    try:
        trainer = build(name)
    except MissingDependencyError as exc:
        result.status, result.reason = SKIPPED, _first_line(exc)
        log(f"  {name}: skipped, {result.reason}")
        return result
    except Exception as exc:  # noqa: BLE001 - one broken backend must not stop the others
        result.status, result.reason = FAILED, f"could not start: {_first_line(exc)}"
        log(f"  {name}: {result.reason}")
        return result
    result.startup_s = time.perf_counter() - start
    try:
        for _ in range(epochs):
            stats = trainer.train(num_steps=num_steps)
            result.losses.append(float(stats["loss"]))
            result.epoch_times_s.append(float(stats.get("epoch_time_s", math.nan)))
            result.samples_per_s.append(float(stats.get("samples_per_s", math.nan)))
            peak = stats.get("peak_memory_mb")
            if peak is not None:
                result.peak_memory_mb = max(result.peak_memory_mb or 0.0, float(peak))
            log(
                f"  {name} epoch {stats.get('epoch', result.epochs - 1)}: loss "
                f"{stats['loss']:.4f}  {stats.get('epoch_time_s', math.nan):.2f} s  "
                f"{stats.get('samples_per_s', math.nan):.0f} samples/s"
            )
        if _can_validate(trainer):
            val = trainer.validate()
            result.val_loss = val.get("val_loss")
            result.val_accuracy = val.get("val_accuracy")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        result.status, result.reason = FAILED, _first_line(exc)
        log(f"  {name}: failed, {result.reason}")
    finally:
        trainer.shutdown()
    return result


def compare_backends(
    run_config_or_creators: Any,
    backends: Sequence[str] | None = None,
    epochs: int | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    num_steps: int | None = None,
    log: Callable[[str], None] | None = print,
) -> list[BackendResult]:
    """Train the same job on each backend in turn and collect comparable metrics.

    Args:
        run_config_or_creators: a :class:`~polytrain.trainer_api.run_config.RunConfig`,
            the path of a YAML run config, or a dict of trainer keyword arguments (the
            creators, ``config``, ``num_workers``, ...; ``trainer_cls`` picks a trainer
            other than TorchTrainer).
        backends: names or aliases; None runs every installed backend of the job's
            framework. Names must be registered; an uninstalled one is skipped.
        epochs: epochs per backend (default: the config's ``epochs``, else 1).
        out_dir: where the CSV, JSON and PNG go (default:
            ``./polytrain_runs/compare-<timestamp>/``).
        num_steps: cap on batches per epoch (default: the config's ``num_steps``).
        log: called with one line per event (None: silent).

    Returns:
        One :class:`BackendResult` per requested backend, in order.

    Raises:
        UnknownBackendError: a name that is not registered, or a backend of another
            framework than the job's; raised before anything runs.
    """
    from polytrain.backends.registry import UnknownBackendError

    log = log or (lambda _line: None)
    framework, build, default_epochs, default_steps = _make_builder(run_config_or_creators)
    names = list(backends) if backends else available_backends(framework)
    if not names:
        raise UnknownBackendError(
            f"No {framework} backend is installed; see `polytrain check` for what is missing."
        )
    for name in names:
        spec = get_spec(name)  # UnknownBackendError lists the valid names
        if spec.framework != framework:
            raise UnknownBackendError(
                f"Backend '{name}' is a {spec.framework} backend; this job trains with "
                f"{framework}. Choose from: {', '.join(available_backends(framework, False))}."
            )
    epochs = epochs if epochs is not None else default_epochs
    num_steps = num_steps if num_steps is not None else default_steps
    results = []
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] {name}: {epochs} epoch(s)")
        results.append(_run_one(name, build, epochs, num_steps, log))
    write_results(results, out_dir if out_dir is not None else default_run_dir("compare"))
    return results


def format_table(results: Sequence[BackendResult]) -> str:
    """The results as an aligned text table (one row per backend)."""
    headers = (
        "backend",
        "status",
        "epoch time (s)",
        "samples/s",
        "final loss",
        "val accuracy",
        "peak MB/worker",
        "note",
    )

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None or math.isnan(value) else format(value, spec)

    rows = [
        (
            r.backend,
            r.status,
            fmt(r.epoch_time_s, ".3f"),
            fmt(r.throughput, ".0f"),
            fmt(r.final_loss, ".4f"),
            fmt(r.val_accuracy, ".3f"),
            fmt(r.peak_memory_mb, ".0f"),
            r.reason,
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    widths[-1] = 0  # the note is last and free-length
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * max(w, len(h)) for h, w in zip(headers, widths, strict=True)))
    lines += [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def write_results(results: Sequence[BackendResult], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``compare.csv``, ``results.json`` and ``compare.png`` into ``out_dir``.

    Returns:
        ``{"csv": path, "json": path, "png": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "compare.csv", "json": out / "results.json", "png": out / "compare.png"}
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(r.row() for r in results)
    payload = [
        {**asdict(r), "epoch_time_s": r.epoch_time_s, "throughput": r.throughput} for r in results
    ]
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    _plot(results, paths["png"])
    return paths


def _plot(results: Sequence[BackendResult], path: Path) -> None:
    # The object-oriented API with the Agg canvas: no pyplot, so the caller's
    # matplotlib backend (a notebook's, say) is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, bar_ax = fig.subplots(1, 2)
    ran = [r for r in results if r.losses]
    for r in ran:
        loss_ax.plot(range(1, r.epochs + 1), r.losses, marker="o", label=r.backend)
    loss_ax.set(title="Training loss per epoch", xlabel="epoch", ylabel="loss")
    if ran:
        loss_ax.legend()
        loss_ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        loss_ax.text(0.5, 0.5, "no backend ran", ha="center", va="center")
    names = [r.backend for r in results]
    rates = [r.throughput or 0.0 for r in results]
    bars = bar_ax.bar(
        names, rates, color=["tab:blue" if r.status == OK else "tab:gray" for r in results]
    )
    for bar, r in zip(bars, results, strict=True):
        label = f"{r.throughput:.0f}" if r.status == OK and r.throughput else r.status
        bar_ax.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    bar_ax.set(title="Throughput (steady state)", ylabel="samples/s")
    fig.savefig(path, dpi=110)
