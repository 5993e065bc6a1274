"""The ``polytrain train``, ``compare`` and ``submit`` commands, and what every command shares.

A face of the package like :mod:`polytrain.cli.main`: nothing below the faces imports
it. Module level imports only the standard library, so ``polytrain --help`` and
``polytrain submit`` load neither torch nor Ray; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ------------------------------------------------------------------ helpers
def print_error(message: str) -> None:
    """Print ``polytrain: error: message`` to stderr, the way argparse reports usage errors."""
    print(f"polytrain: error: {message}", file=sys.stderr, flush=True)


def split_names(value: str | None) -> list[str] | None:
    """``"ddp, fsdp"`` -> ``["ddp", "fsdp"]``; None for an empty option."""
    if not value:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def fmt(value: Any, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``, or "-" when it is None."""
    return "-" if value is None else format(value, spec)


def ray_summary() -> str:
    """One line about the connected Ray instance: version, address, nodes, CPUs, GPUs."""
    import ray

    context = ray.get_runtime_context()
    resources = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return (
        f"Ray {ray.__version__} at {context.gcs_address}: {nodes} node(s), "
        f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"
    )


# -------------------------------------------------------------------- train
def _train_overrides(args: argparse.Namespace, run_dir: Path | None) -> list[str]:
    # The command line shows a progress bar unless told not to, or the overrides decide.
    overrides = list(args.overrides)
    if run_dir is not None:
        # Epoch-end checkpoints go into the run directory unless the config says where,
        # so that `polytrain train --resume --out <run dir>` can continue the run.
        overrides.insert(0, f"checkpoint.checkpoint_dir={run_dir / 'checkpoints'}")
    if getattr(args, "resume", False):
        overrides.append("checkpoint.resume=true")
    if args.no_progress:
        overrides.append("use_tqdm=false")
    elif not any(o.startswith("use_tqdm=") for o in overrides):
        overrides.append("use_tqdm=true")
    return overrides


def _epoch_line(stats: dict[str, Any], val: dict[str, Any]) -> str:
    return (
        f"epoch {stats.get('epoch')}: loss {fmt(stats.get('loss'))}"
        f"  val_loss {fmt(val.get('val_loss'))}"
        f"  val_accuracy {fmt(val.get('val_accuracy'), '.3f')}"
        f"  {fmt(stats.get('samples_per_s'), '.0f')} samples/s"
        f"  {fmt(stats.get('epoch_time_s'), '.2f')} s"
        f"  peak {fmt(stats.get('peak_memory_mb'), '.0f')} MB/worker"
    )


def _train_epochs(run: Any, trainer: Any, metrics_path: Path) -> None:
    """Train up to ``run.epochs`` epochs: a line per epoch on stdout and in ``metrics_path``.

    A resumed trainer starts at its checkpoint's epoch; the epochs before it are
    already in ``metrics_path``, which is appended to.
    """
    from polytrain.compare.runner import _can_validate, train_epoch

    validate = run.validate_each_epoch and _can_validate(trainer)
    if trainer.epoch:
        print(f"resumed at epoch {trainer.epoch} of {run.epochs}", flush=True)
    with metrics_path.open("a" if trainer.epoch else "w") as metrics:
        while trainer.epoch < run.epochs:
            stats = train_epoch(trainer, run.num_steps)
            val = trainer.validate() if validate else {}
            print(_epoch_line(stats, val), flush=True)
            metrics.write(json.dumps({**stats, **val}, default=str) + "\n")


def cmd_train(args: argparse.Namespace) -> int:
    """Train one run config: progress bar, a metrics line per epoch, a final checkpoint."""
    import yaml

    from polytrain.compare.runner import default_run_dir
    from polytrain.loggers import resolve_loggers
    from polytrain.trainer_api.options.run_config import connect_ray, load_config

    configured = load_config(args.config, args.overrides).checkpoint.checkpoint_dir
    if args.resume and not (args.out or configured):
        raise ConfigError(
            "--resume continues a run from its checkpoints, but neither --out (the run "
            "directory to continue) nor checkpoint.checkpoint_dir in the config says where "
            "they are. Pass --out polytrain_runs/<the run>."
        )
    run_dir = Path(args.out) if args.out else default_run_dir(Path(args.config).stem)
    run = load_config(args.config, _train_overrides(args, None if configured else run_dir))
    # Named loggers write into the run directory; the trainer drives them.
    loggers = resolve_loggers(split_names(args.logger) or run.loggers, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
    scaling = run.scaling_config()
    if not scaling.local_mode:
        connect_ray(args.address or scaling.address)
        print(ray_summary(), flush=True)
    print(
        f"training {run.model} on backend '{run.backend}' with {scaling.world_size} worker(s) "
        f"for {run.epochs} epoch(s); run directory {run_dir}",
        flush=True,
    )
    trainer = run.build_trainer(**({"loggers": loggers} if loggers else {}))
    try:
        _train_epochs(run, trainer, run_dir / "metrics.jsonl")
        # The run directory, whatever checkpoint.checkpoint_dir says: final.pt sits next to
        # metrics.jsonl and run_config.yaml, where --out (or the printed path) points.
        path = trainer.save(run_dir / "final.pt")
    finally:
        trainer.shutdown()  # also finishes the loggers
    print(f"checkpoint: {path}", flush=True)
    print(f"metrics: {run_dir / 'metrics.jsonl'}", flush=True)
    for logger in loggers:
        print(f"{logger.name}: {_logger_location(logger)}", flush=True)
    return EXIT_OK


def _logger_location(logger: Any) -> str:
    for attr in ("log_dir", "path", "tracking_uri", "save_dir"):
        if getattr(logger, attr, None) is not None:
            return str(getattr(logger, attr))
    return type(logger).__name__


# ------------------------------------------------------------------ compare
def cmd_compare(args: argparse.Namespace) -> int:
    """Run the config on several backends; print a table, write CSV + PNG."""
    from polytrain.compare.runner import FAILED, OK, compare_backends, default_run_dir, format_table
    from polytrain.trainer_api.options.run_config import connect_ray, load_config

    run = load_config(args.config, args.overrides)
    out_dir = Path(args.out) if args.out else default_run_dir("compare")
    if not run.scaling_config().local_mode:
        connect_ray(args.address or run.scaling.address)
        print(ray_summary(), flush=True)
    results = compare_backends(
        run,
        split_names(args.backends),
        epochs=args.epochs,
        out_dir=out_dir,
        num_steps=args.num_steps,
        tolerance=args.tolerance,
    )
    print()
    print(format_table(results))
    print()
    print(f"results: {out_dir / 'compare.csv'}")
    print(f"         {out_dir / 'results.json'}")
    print(f"plot:    {out_dir / 'compare.png'}")
    if any(r.status == FAILED for r in results) or not any(r.status == OK for r in results):
        return EXIT_FAILED
    return EXIT_OK


# ------------------------------------------------------------------- submit
def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a command to a Ray cluster (Jobs API), stream its log, return its status."""
    from polytrain.launchers.cluster.jobs import read_requirements, run_job

    entrypoint = list(args.entrypoint)
    if entrypoint and entrypoint[0] == "--":
        entrypoint = entrypoint[1:]
    if not entrypoint:
        print_error(
            "submit needs the job's command after `--`, e.g. -- polytrain train -c cfg.yaml"
        )
        return EXIT_USAGE
    working_dir = None if args.no_working_dir else args.working_dir
    env_vars = dict(item.split("=", 1) for item in args.env)
    pip = [*(read_requirements(args.requirements) if args.requirements else []), *args.pip]
    print(f"submitting to {args.address}: {' '.join(entrypoint)}", flush=True)
    try:
        outcome = run_job(
            args.address,
            entrypoint,
            working_dir=working_dir,
            excludes=args.exclude,
            env_vars=env_vars,
            wait=not args.no_wait,
            timeout_s=args.timeout,
            pip=pip,
        )
    except KeyboardInterrupt:
        print_error("interrupted; the job was stopped")
        return 130
    if args.no_wait:
        print(f"job {outcome.job_id} submitted; follow it with `ray job logs -f {outcome.job_id}`")
        return EXIT_OK
    if outcome.exit_code:
        print(
            f"\njob {outcome.job_id} {outcome.status}: {outcome.message}\n--- last log lines "
            f"---\n{outcome.log_tail()}",
            file=sys.stderr,
        )
    else:
        print(f"\njob {outcome.job_id} {outcome.status}")
    return outcome.exit_code
