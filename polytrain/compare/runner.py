"""Run the same job on several backends and compare speed, memory and accuracy.

From Python::

    from polytrain.compare.runner import compare_backends
    results = compare_backends("examples/configs/ddp.yaml", ["ddp", "horovod"], epochs=3)

A run config with a ``torch:`` and a ``tensorflow:`` section (see
``examples/configs/digits_both.yaml``) runs the backends of both frameworks, so
``mwms`` lands in the same table and plot as the torch backends.

Or with your own creators (the TorchTrainer keyword arguments)::

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
still run. Backends of one framework whose final losses or validation metrics
differ by more than ``tolerance`` (2 % relative by default) are flagged with the
setting that usually causes it (:mod:`polytrain.compare.divergence`). The results
go to ``compare.csv``, ``results.json`` and ``compare.png`` (loss curves and a
throughput bar chart) in ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain.backends.registry import available_backends, get_spec
from polytrain.compare.divergence import DEFAULT_TOLERANCE, flag_divergence
from polytrain.compare.report import (
    CSV_COLUMNS,
    FAILED,
    OK,
    SKIPPED,
    BackendResult,
    format_table,
    write_results,
)
from polytrain.compat.imports import MissingDependencyError, install_hint, module_available
from polytrain.errors import ConfigTypeError
from polytrain.trainer_api.trainable import train_epoch

__all__ = [
    "CSV_COLUMNS",
    "FAILED",
    "OK",
    "SKIPPED",
    "BackendResult",
    "DEFAULT_TOLERANCE",
    "compare_backends",
    "default_run_dir",
    "flag_divergence",
    "format_table",
    "write_results",
]


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


def _make_builder(run: Any) -> tuple[tuple[str, ...], Callable[[str], Any], int, int | None]:
    """(frameworks, backend name -> trainer, default epochs, default num_steps)."""
    from polytrain.trainer_api.options.run_config import RunConfig, load_config

    if isinstance(run, (str, os.PathLike)):
        run = load_config(run)
    if isinstance(run, RunConfig):
        config = run

        def build(name: str) -> Any:
            # with_backend also switches framework when the config carries both.
            return config.with_backend(name, use_tqdm=False).build_trainer()

        return config.frameworks, build, config.epochs, config.num_steps
    if isinstance(run, Mapping):
        kwargs = dict(run)
        kwargs.pop("backend", None)
        kwargs.pop("backend_config", None)
        trainer_cls = kwargs.pop("trainer_cls", None)
        if trainer_cls is None:
            from polytrain.trainer_api.torch.trainer import TorchTrainer

            trainer_cls = TorchTrainer

        def build_from_kwargs(name: str) -> Any:
            return trainer_cls(**kwargs, backend=name)

        return (getattr(trainer_cls, "framework", "torch"),), build_from_kwargs, 1, None
    raise ConfigTypeError(
        f"compare_backends takes a RunConfig, the path of a YAML run config, or a dict of "
        f"trainer keyword arguments (model_creator=..., ...); got {type(run).__name__}: {run!r}."
    )


def _settings(trainer: Any) -> dict[str, Any]:
    """The trainer's settings that can change results: ``use_fp16`` and the backend's options."""
    from polytrain.loggers import flatten_params

    settings: dict[str, Any] = {"use_fp16": bool(getattr(trainer, "use_fp16", False))}
    config = getattr(getattr(trainer, "backend", None), "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        options = flatten_params({"backend_config": dataclasses.asdict(config)}, sep=".")
        settings.update(options)
    return settings


def _record_epoch(
    result: BackendResult, stats: Mapping[str, Any], log: Callable[[str], None]
) -> None:
    """Add one epoch's train stats to ``result`` and log them."""
    result.losses.append(float(stats["loss"]))
    result.epoch_times_s.append(float(stats.get("epoch_time_s", math.nan)))
    result.samples_per_s.append(float(stats.get("samples_per_s", math.nan)))
    if stats.get("tokens_per_s") is not None:
        result.tokens_per_s.append(float(stats["tokens_per_s"]))
    if stats.get("grad_norm") is not None:
        result.grad_norms.append(float(stats["grad_norm"]))
    peak = stats.get("peak_memory_mb")
    if peak is not None:
        result.peak_memory_mb = max(result.peak_memory_mb or 0.0, float(peak))
    log(
        f"  {result.backend} epoch {stats.get('epoch', result.epochs - 1)}: loss "
        f"{stats['loss']:.4f}  {stats.get('epoch_time_s', math.nan):.2f} s  "
        f"{stats.get('samples_per_s', math.nan):.0f} samples/s"
    )


def _run_one(
    name: str,
    build: Callable[[str], Any],
    epochs: int,
    num_steps: int | None,
    log: Callable[[str], None],
) -> BackendResult:
    result = BackendResult(backend=name, framework=get_spec(name).framework)
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
    result.settings = _settings(trainer)
    try:
        for _ in range(epochs):
            _record_epoch(result, train_epoch(trainer, num_steps), log)
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


def _backend_names(backends: Sequence[str] | None, frameworks: tuple[str, ...]) -> list[str]:
    """The backends to run: as given (checked), or every installed one of ``frameworks``."""
    from polytrain.backends.registry import UnknownBackendError

    names = list(backends) if backends else [n for f in frameworks for n in available_backends(f)]
    if not names:
        raise UnknownBackendError(
            f"No {' or '.join(frameworks)} backend is installed; see `polytrain check` for what "
            f"is missing."
        )
    for name in names:
        spec = get_spec(name)  # UnknownBackendError lists the valid names
        if spec.framework not in frameworks:
            valid = [n for f in frameworks for n in available_backends(f, False)]
            raise UnknownBackendError(
                f"Backend '{name}' is a {spec.framework} backend; this job trains with "
                f"{' and '.join(frameworks)}. Choose from: {', '.join(valid)} (or add a "
                f"{spec.framework}: section to the run config)."
            )
    return names


def compare_backends(
    run_config_or_creators: Any,
    backends: Sequence[str] | None = None,
    epochs: int | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    num_steps: int | None = None,
    log: Callable[[str], None] | None = print,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[BackendResult]:
    """Train the same job on each backend in turn and collect comparable metrics.

    Args:
        run_config_or_creators: a :class:`~polytrain.trainer_api.options.run_config.RunConfig`,
            the path of a YAML run config, or a dict of trainer keyword arguments (the
            creators, ``config``, ``num_workers``, ...; ``trainer_cls`` picks a trainer
            other than TorchTrainer).
        backends: names or aliases; None runs every installed backend of the job's
            framework (of both, for a config with ``torch:`` and ``tensorflow:``
            sections). Names must be registered; an uninstalled one is skipped.
        epochs: epochs per backend (default: the config's ``epochs``, else 1).
        out_dir: where the CSV, JSON and PNG go (default:
            ``./polytrain_runs/compare-<timestamp>/``).
        num_steps: cap on batches per epoch (default: the config's ``num_steps``).
        log: called with one line per event (None: silent).
        tolerance: relative difference in final loss / validation metrics from the
            framework's first backend beyond which a result is flagged (0.02 = 2 %).

    Returns:
        One :class:`BackendResult` per requested backend, in order; diverging ones
        have ``divergences`` and a ``divergence_hint``.

    Raises:
        UnknownBackendError: a name that is not registered, or a backend of another
            framework than the job's; raised before anything runs.
    """
    log = log or (lambda _line: None)
    frameworks, build, default_epochs, default_steps = _make_builder(run_config_or_creators)
    names = _backend_names(backends, frameworks)
    flag_divergence([], tolerance)  # a bad tolerance fails before anything runs
    epochs = epochs if epochs is not None else default_epochs
    num_steps = num_steps if num_steps is not None else default_steps
    results = []
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] {name}: {epochs} epoch(s)")
        results.append(_run_one(name, build, epochs, num_steps, log))
    for result in flag_divergence(results, tolerance):
        log(f"  ! {result.backend}: {result.divergence_note()}")
    write_results(results, out_dir if out_dir is not None else default_run_dir("compare"))
    return results
