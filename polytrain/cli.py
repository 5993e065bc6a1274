"""The ``polytrain`` command: train, compare, check, submit.

::

    polytrain train   -c examples/configs/ddp.yaml [key=value ...]
    polytrain compare -c examples/configs/ddp.yaml --backends ddp,horovod,deepspeed
    polytrain check   [--address ADDR] [--backends ddp,fsdp]
    polytrain submit  --address http://HEAD:8265 -- polytrain train -c cfg.yaml

Overrides use dotted keys with YAML values: ``backend=horovod num_workers=4
config.lr=0.05 scaling.num_cpus_per_worker=2``.

Like ``polytrain/__init__.py`` this module is a face of the package: nothing in
the package imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ------------------------------------------------------------------ helpers
def _err(message: str) -> None:
    print(f"polytrain: error: {message}", file=sys.stderr, flush=True)


def _split_names(value: str | None) -> list[str] | None:
    if not value:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _ray_summary() -> str:
    import ray

    context = ray.get_runtime_context()
    resources = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return (
        f"Ray {ray.__version__} at {context.gcs_address}: {nodes} node(s), "
        f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"
    )


# -------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    """Train one run config: progress bar, a metrics line per epoch, a final checkpoint."""
    from polytrain.compare import _can_validate, default_run_dir
    from polytrain.trainer_api.run_config import connect_ray, load_config

    overrides = list(args.overrides)
    if args.no_progress:
        overrides.append("use_tqdm=false")
    elif not any(o.startswith("use_tqdm=") for o in overrides):
        overrides.append("use_tqdm=true")
    run = load_config(args.config, overrides)
    run_dir = Path(args.out) if args.out else default_run_dir(Path(args.config).stem)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(run.checkpoint.checkpoint_dir or run_dir)
    import yaml

    (run_dir / "run_config.yaml").write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
    scaling = run.scaling_config()
    if not scaling.local_mode:
        connect_ray(args.address or scaling.address)
        print(_ray_summary(), flush=True)
    print(
        f"training {run.model} on backend '{run.backend}' with {scaling.world_size} worker(s) "
        f"for {run.epochs} epoch(s); run directory {run_dir}",
        flush=True,
    )
    trainer = run.build_trainer()
    try:
        validate = run.validate_each_epoch and _can_validate(trainer)
        with (run_dir / "metrics.jsonl").open("w") as metrics:
            for _ in range(run.epochs):
                stats = trainer.train(num_steps=run.num_steps)
                val = trainer.validate() if validate else {}
                line = (
                    f"epoch {stats.get('epoch')}: loss {_fmt(stats.get('loss'))}"
                    f"  val_loss {_fmt(val.get('val_loss'))}"
                    f"  val_accuracy {_fmt(val.get('val_accuracy'), '.3f')}"
                    f"  {_fmt(stats.get('samples_per_s'), '.0f')} samples/s"
                    f"  {_fmt(stats.get('epoch_time_s'), '.2f')} s"
                    f"  peak {_fmt(stats.get('peak_memory_mb'), '.0f')} MB/worker"
                )
                print(line, flush=True)
                metrics.write(json.dumps({**stats, **val}, default=str) + "\n")
        path = trainer.save(ckpt_dir / "final.pt")
    finally:
        trainer.shutdown()
    print(f"checkpoint: {path}", flush=True)
    print(f"metrics: {run_dir / 'metrics.jsonl'}", flush=True)
    return EXIT_OK


# ------------------------------------------------------------------ compare
def cmd_compare(args: argparse.Namespace) -> int:
    """Run the config on several backends; print a table, write CSV + PNG."""
    from polytrain.compare import FAILED, OK, compare_backends, default_run_dir, format_table
    from polytrain.trainer_api.run_config import connect_ray, load_config

    run = load_config(args.config, args.overrides)
    out_dir = Path(args.out) if args.out else default_run_dir("compare")
    if not run.scaling_config().local_mode:
        connect_ray(args.address or run.scaling.address)
        print(_ray_summary(), flush=True)
    results = compare_backends(
        run,
        _split_names(args.backends),
        epochs=args.epochs,
        out_dir=out_dir,
        num_steps=args.num_steps,
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


# -------------------------------------------------------------------- check
def _tiny_model(config: dict) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _tiny_data(config: dict) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=config.get("batch_size", 8))


def _tiny_optimizer(model: Any, config: dict) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1)


def _tiny_loss(config: dict) -> Any:
    import torch

    return torch.nn.CrossEntropyLoss()


def _worker_environment() -> dict[str, Any]:
    """Worker side: versions of the core packages and where polytrain comes from."""
    import platform
    import socket

    import ray
    import torch

    import polytrain

    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "polytrain": polytrain.__version__,
        "polytrain_path": str(Path(polytrain.__file__).parent),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def _worker_import_backend(name: str) -> dict[str, Any]:
    """Worker side: import a backend's packages and class; report versions or the error."""
    import importlib

    from polytrain.backends.registry import get_backend_class, get_spec
    from polytrain.compat.imports import install_hint, module_available

    spec = get_spec(name)
    missing = [m for m in spec.requires if not module_available(m)]
    if missing:
        return {
            "installed": False,
            "error": f"{', '.join(missing)} missing: {install_hint(missing[0])}",
        }
    versions = {}
    try:
        for module in spec.requires:
            root = importlib.import_module(module.split(".")[0])
            importlib.import_module(module)
            versions[root.__name__] = getattr(root, "__version__", "?")
        get_backend_class(name)
    except BaseException as exc:  # noqa: BLE001 - reported as the row's error
        return {"installed": True, "error": f"import failed: {type(exc).__name__}: {exc}"}
    return {"installed": True, "error": None, "versions": versions}


class _Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, status: str, detail: str) -> None:
        self.rows.append((check, status, detail))
        print(f"  {status:<4}  {check}: {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _ in self.rows)

    def table(self) -> str:
        width = max(len(c) for c, _, _ in self.rows)
        lines = [f"{'check'.ljust(width)}  status  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{c.ljust(width)}  {s.ljust(6)}  {d}" for c, s, d in self.rows]
        return "\n".join(lines)


def _check_backends(
    report: _Report, names: list[str], requested: bool, timeout_s: float
) -> list[str]:
    """Import check on a worker for each backend; returns the names that imported."""
    import ray

    from polytrain.backends.registry import UnknownBackendError, get_spec

    specs = []
    for name in names:
        try:
            specs.append((name, get_spec(name)))
        except UnknownBackendError as exc:
            report.add(f"backend {name}", "FAIL", str(exc))
    task = ray.remote(num_cpus=0)(_worker_import_backend)
    refs = {name: task.remote(spec.name) for name, spec in specs}
    ready = []
    for name, spec in specs:
        label = f"backend {name}"
        try:
            answer = ray.get(refs[name], timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot even run the check
            report.add(label, "FAIL", f"import check on a worker failed: {exc}")
            continue
        if not answer["installed"]:
            report.add(label, "FAIL" if requested else "SKIP", f"not installed: {answer['error']}")
        elif answer["error"]:
            report.add(label, "FAIL", answer["error"])
        else:
            versions = ", ".join(f"{k} {v}" for k, v in answer["versions"].items())
            report.add(label, "OK", f"{spec.framework}; importable on workers ({versions})")
            ready.append(spec.name)
    return ready


def _check_collective(report: _Report, name: str, num_workers: int) -> None:
    from polytrain.trainer_api.torch_trainer import TorchTrainer

    label = f"collective {name}"
    start = time.perf_counter()
    trainer = None
    try:
        trainer = TorchTrainer(
            model_creator=_tiny_model,
            data_creator=_tiny_data,
            optimizer_creator=_tiny_optimizer,
            loss_creator=_tiny_loss,
            config={"batch_size": 8 * num_workers},
            num_workers=num_workers,
            backend=name,
        )
        stats = trainer.train(num_steps=2)
        report.add(
            label,
            "OK",
            f"{num_workers} workers trained 2 steps (loss {stats['loss']:.3f}) in "
            f"{time.perf_counter() - start:.1f} s",
        )
    except Exception as exc:  # noqa: BLE001 - reported as the row
        first = str(exc).strip().splitlines()
        report.add(label, "FAIL", f"{type(exc).__name__}: {first[0] if first else ''}")
    finally:
        if trainer is not None:
            trainer.shutdown()


def cmd_check(args: argparse.Namespace) -> int:
    """Pre-flight: Ray, resources, versions, backends importable on workers, collectives."""
    import ray

    import polytrain
    from polytrain.backends.registry import describe_backends, get_spec
    from polytrain.trainer_api.run_config import connect_ray

    report = _Report()
    print("polytrain check", flush=True)
    try:
        connect_ray(args.address)
    except ConnectionError as exc:
        report.add("ray", "FAIL", str(exc))
        print("\n" + report.table())
        return EXIT_FAILED
    report.add("ray", "OK", _ray_summary())
    resources = ray.cluster_resources()
    cpus = resources.get("CPU", 0)
    report.add(
        "resources",
        "OK" if cpus >= args.num_workers else "FAIL",
        f"{cpus:g} CPU, {resources.get('GPU', 0):g} GPU available in total"
        + ("" if cpus >= args.num_workers else f"; the checks need {args.num_workers} CPUs"),
    )
    import platform

    import torch

    driver = {
        "python": platform.python_version(),
        "polytrain": polytrain.__version__,
        "torch": torch.__version__,
        "ray": ray.__version__,
    }
    try:
        worker = ray.get(ray.remote(num_cpus=0)(_worker_environment).remote(), timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - e.g. polytrain not importable on the workers
        report.add("workers", "FAIL", f"a worker could not import polytrain/torch: {exc}")
    else:
        mismatch = [k for k in driver if driver[k] != worker[k]]
        versions = ", ".join(f"{k} {worker[k]}" for k in driver)
        if mismatch:
            report.add(
                "versions",
                "FAIL",
                "driver and workers differ in "
                + ", ".join(f"{k} ({driver[k]} vs {worker[k]})" for k in mismatch),
            )
        else:
            report.add("versions", "OK", f"{versions}; polytrain from {worker['polytrain_path']}")
    requested = _split_names(args.backends)
    names = requested or [spec.name for spec in describe_backends()]
    ready = _check_backends(report, names, bool(requested), args.timeout)
    if not args.no_collective:
        if cpus < args.num_workers:
            report.add("collectives", "FAIL", f"skipped: fewer than {args.num_workers} CPUs")
        for name in ready:
            if get_spec(name).framework == "torch":
                _check_collective(report, name, args.num_workers)
            else:
                report.add(
                    f"collective {name}", "SKIP", "import checked only (not a torch backend)"
                )
    print("\n" + report.table())
    if report.failed:
        print("\npolytrain check: FAILED (see the FAIL rows above)", file=sys.stderr)
        return EXIT_FAILED
    print("\npolytrain check: all good")
    return EXIT_OK


# ------------------------------------------------------------------- submit
def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a command to a Ray cluster (Jobs API), stream its log, return its status."""
    from polytrain.launchers.jobs import run_job

    entrypoint = list(args.entrypoint)
    if entrypoint and entrypoint[0] == "--":
        entrypoint = entrypoint[1:]
    if not entrypoint:
        _err("submit needs the job's command after `--`, e.g. -- polytrain train -c cfg.yaml")
        return EXIT_USAGE
    working_dir = None if args.no_working_dir else args.working_dir
    env_vars = dict(item.split("=", 1) for item in args.env)
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
        )
    except KeyboardInterrupt:
        _err("interrupted; the job was stopped")
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


# --------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``polytrain`` command."""
    import polytrain

    parser = argparse.ArgumentParser(
        prog="polytrain",
        description="One trainer API, every distributed backend.",
        epilog="Overrides are dotted keys with YAML values: backend=horovod config.lr=0.05",
    )
    parser.add_argument("--version", action="version", version=f"polytrain {polytrain.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ray_help = (
        "Ray cluster to use (host:port or 'auto'); default: RAY_ADDRESS, else a new local one"
    )

    train = sub.add_parser("train", help="train a YAML run config")
    train.add_argument("-c", "--config", required=True, help="the YAML run config")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    train.add_argument("--out", help="run directory (default: ./polytrain_runs/<config>-<time>/)")
    train.add_argument("--address", help=ray_help)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    compare = sub.add_parser("compare", help="run one config on several backends and compare")
    compare.add_argument("-c", "--config", required=True, help="the YAML run config")
    compare.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    compare.add_argument(
        "--backends", help="comma-separated names (default: every installed backend)"
    )
    compare.add_argument("--epochs", type=int, help="epochs per backend (default: the config's)")
    compare.add_argument("--num-steps", type=int, help="batches per epoch (default: all)")
    compare.add_argument(
        "--out", help="output directory (default: ./polytrain_runs/compare-<time>/)"
    )
    compare.add_argument("--address", help=ray_help)
    compare.set_defaults(func=cmd_compare)

    check = sub.add_parser("check", help="pre-flight check of Ray, backends and collectives")
    check.add_argument("--address", help=ray_help)
    check.add_argument("--backends", help="comma-separated names to require (default: all)")
    check.add_argument("--no-collective", action="store_true", help="skip the training steps")
    check.add_argument("--num-workers", type=int, default=2, help="workers per collective check")
    check.add_argument("--timeout", type=float, default=180.0, help="seconds per worker check")
    check.set_defaults(func=cmd_check)

    submit = sub.add_parser(
        "submit",
        help="run a command on a Ray cluster through the Jobs API",
        description="Example: polytrain submit --address http://HEAD:8265 -- polytrain train "
        "-c examples/configs/ddp.yaml",
    )
    submit.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"),
        help="the head's dashboard address (default: RAY_API_SERVER_ADDRESS or "
        "http://127.0.0.1:8265)",
    )
    submit.add_argument("--working-dir", default=".", help="uploaded with the job (default: .)")
    submit.add_argument("--no-working-dir", action="store_true", help="upload nothing")
    submit.add_argument(
        "--exclude", action="append", default=[], help="more patterns not to upload"
    )
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="job environment"
    )
    submit.add_argument("--no-wait", action="store_true", help="return once submitted")
    submit.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    submit.set_defaults(func=cmd_submit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``polytrain`` command; returns its exit status."""
    from polytrain.errors import ConfigError, PolytrainError

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "env", None):
        bad = [item for item in args.env if "=" not in item]
        if bad:
            parser.error(f"--env takes KEY=VALUE; got {bad}")
    try:
        return args.func(args)
    except (PolytrainError, ConnectionError, ValueError, ImportError, FileNotFoundError) as exc:
        # The registry imports torch: look its error class up only if it was loaded
        # (`polytrain submit` and `--help` never load it).
        registry = sys.modules.get("polytrain.backends.registry")
        usage = (ConfigError, registry.UnknownBackendError) if registry else (ConfigError,)
        if isinstance(exc, usage):
            _err(str(exc))
            return EXIT_USAGE
        _err(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
