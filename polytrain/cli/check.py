"""``polytrain check``: a pre-flight check of Ray, versions, backends and collectives.

Each check adds a row (OK, FAIL or SKIP) to a report that is printed as it goes
and as a table at the end. The backend and environment checks run on a Ray
worker, because what matters is what the workers can import, not the driver.
A face of the package like :mod:`polytrain.cli.main`; module level imports only the
standard library.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import re
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from polytrain.cli.commands import EXIT_FAILED, EXIT_OK, ray_summary, split_names


# --------------------------------------------- the job of the collective check
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


# ------------------------------------------------------------- worker side
def _core_versions() -> dict[str, str]:
    """The versions that must agree between the driver and the workers."""
    import ray
    import torch

    import polytrain

    return {
        "python": platform.python_version(),
        "polytrain": polytrain.__version__,
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def _worker_environment() -> dict[str, Any]:
    """Worker side: versions of the core packages and where polytrain comes from."""
    import polytrain

    return {
        "host": socket.gethostname(),
        **_core_versions(),
        "polytrain_path": str(Path(polytrain.__file__).parent),
    }


def _worker_import_backend(name: str) -> dict[str, Any]:
    """Worker side: import a backend's packages and class; report versions or the error."""
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


# ------------------------------------------------------------------ report
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


# ------------------------------------------------------------------ checks
def _check_resources(report: _Report, num_workers: int) -> float:
    """Whether the cluster has a CPU per collective-check worker; returns its CPUs."""
    import ray

    resources = ray.cluster_resources()
    cpus = resources.get("CPU", 0)
    report.add(
        "resources",
        "OK" if cpus >= num_workers else "FAIL",
        f"{cpus:g} CPU, {resources.get('GPU', 0):g} GPU available in total"
        + ("" if cpus >= num_workers else f"; the checks need {num_workers} CPUs"),
    )
    return cpus


def _check_versions(report: _Report, timeout_s: float) -> None:
    """Whether a worker imports polytrain and torch in the driver's versions."""
    import ray

    driver = _core_versions()
    try:
        worker = ray.get(ray.remote(num_cpus=0)(_worker_environment).remote(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - e.g. polytrain not importable on the workers
        report.add("workers", "FAIL", f"a worker could not import polytrain/torch: {exc}")
        return
    mismatch = [k for k in driver if driver[k] != worker[k]]
    if mismatch:
        report.add(
            "versions",
            "FAIL",
            "driver and workers differ in "
            + ", ".join(f"{k} ({driver[k]} vs {worker[k]})" for k in mismatch),
        )
    else:
        versions = ", ".join(f"{k} {worker[k]}" for k in driver)
        report.add("versions", "OK", f"{versions}; polytrain from {worker['polytrain_path']}")


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
    """Train two steps of a tiny model on ``num_workers`` workers of backend ``name``."""
    from polytrain.trainer_api.torch.trainer import TorchTrainer

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


def _check_collectives(report: _Report, ready: list[str], num_workers: int, cpus: float) -> None:
    """The collective check of every torch backend that imported; the others are skipped."""
    from polytrain.backends.registry import get_spec

    if cpus < num_workers:
        report.add("collectives", "FAIL", f"skipped: fewer than {num_workers} CPUs")
    for name in ready:
        if get_spec(name).framework == "torch":
            _check_collective(report, name, num_workers)
        else:
            report.add(f"collective {name}", "SKIP", "import checked only (not a torch backend)")


# ------------------------------------------------------ cluster and its node types
def _check_nodes(report: _Report, cluster_config: str | None) -> None:
    """The live nodes, and next to them the autoscaler's node types and their limits."""
    from polytrain.launchers.cluster import autoscaler

    live = autoscaler.live_nodes()
    report.add("live nodes", "OK", "; ".join(_describe_node(n) for n in live) or "none")
    try:
        shape = autoscaler.read_cluster_shape(cluster_config)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is this row's finding
        report.add("autoscaler", "FAIL", f"cannot read {cluster_config}: {exc}")
        return
    if shape is None:
        why = "no autoscaler node types visible here (GCS, autoscaling config on this host)"
        report.add("autoscaler", "SKIP", f"{why}; --cluster-config FILE names them")
        return
    status = autoscaler.read_autoscaler_status()
    counts = autoscaler.live_counts_from_status(status)
    pending = autoscaler.pending_from_status(status)
    now = ", ".join(f"{t.name}: {counts.get(t.name, 0)} live" for t in shape.node_types)
    launching = f"; launching {pending}" if pending else ""
    report.add("autoscaler", "OK", f"{shape.describe()} [{now}{launching}] from {shape.source}")
    if shape.setup:
        _check_node_setup(report, shape.setup, Path(shape.source or "."))


def _describe_node(resources: dict[str, float]) -> str:
    head = " (head)" if "node:__internal_head__" in resources else ""
    ip = next((k[5:] for k in resources if k.startswith("node:") and "__" not in k), "?")
    return f"{ip}{head} {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def _check_node_setup(report: _Report, config: dict, source: Path) -> None:
    """Warn for each node type whose setup commands leave a backend's package out."""
    from polytrain.backends.registry import describe_backends
    from polytrain.launchers.cluster.autoscaler import node_setup_commands

    if config.get("kind") in ("RayCluster", "RayJob"):
        report.add(
            "node setup", "SKIP", "the nodes run an image; the backend rows check what it has"
        )
        return
    needed = {s.name: s.extra for s in describe_backends() if s.extra}
    for node_type, commands in node_setup_commands(config).items():
        extras = installed_extras(commands, _repo_of(source))
        missing = sorted(name for name, extra in needed.items() if extra not in extras)
        if missing:
            report.add(
                f"setup {node_type}",
                "WARN",
                f"its setup_commands install no package for {', '.join(missing)}",
            )
        else:
            report.add(f"setup {node_type}", "OK", "its setup_commands install every backend")


def _repo_of(path: Path) -> Path:
    """The checkout whose scripts/setup.sh the cluster file runs: the file's, else ours."""
    import polytrain

    here = Path(polytrain.__file__).resolve().parents[1]
    for parent in [*path.resolve().parents, Path.cwd(), here]:
        if (parent / "scripts" / "setup.sh").is_file():
            return parent
    return Path.cwd()


def _extra_distributions() -> dict[str, set[str]]:
    """polytrain's extras and the distributions each installs (the package metadata)."""
    from importlib.metadata import requires

    extras: dict[str, set[str]] = {}
    for requirement in requires("polytrain") or []:
        found = re.match(r"\s*([\w.\-]+).*extra\s*==\s*['\"]([\w\-]+)['\"]", requirement)
        if found:
            extras.setdefault(found[2], set()).add(_dist(found[1]))
    return extras


def _dist(name: str) -> str:
    return re.split(r"[\[<>=!~;\s]", name.strip("'\""), maxsplit=1)[0].lower().replace("_", "-")


def installed_extras(commands: list[str], repo: Path) -> set[str]:
    """The polytrain extras a node's setup commands install (Horovod's build as "horovod").

    Understands ``pip install`` of ``polytrain[...]`` / ``.[...]`` and of plain packages,
    ``scripts/install_horovod.sh``, and ``scripts/setup.sh`` (read from ``repo``; it
    builds Horovod unless ``SKIP_HOROVOD=1``). An extra counts when all its packages do.
    """
    named, dists = set(), set()
    for command in commands:
        if "setup.sh" in command and "install_horovod" not in command:
            script = repo / "scripts" / "setup.sh"
            lines = script.read_text().splitlines() if script.is_file() else []
            lines = [ln for ln in lines if not ln.lstrip().startswith("#") and "setup.sh" not in ln]
            sub = installed_extras(lines, repo)
            named |= sub - ({"horovod"} if "SKIP_HOROVOD=1" in command else set())
        if "install_horovod.sh" in command:
            named.add("horovod")
        for pip_args in re.findall(r"pip3?\s+install\s+([^;&|]*)", command):
            try:
                words = shlex.split(pip_args.replace("$", ""))
            except ValueError:  # unbalanced quotes: words as they stand
                words = pip_args.split()
            for word in words:
                bracket = re.match(r"(?:.*polytrain[^\[]*|\.)\[([\w,\- ]+)\]$", word)
                if bracket:
                    named |= {e.strip() for e in bracket[1].split(",")}
                elif not word.startswith("-"):
                    dists.add(_dist(word))
    extras = _extra_distributions()
    for extra in named:
        dists |= extras.get(extra, set())
    return named | {e for e, needs in extras.items() if needs and needs <= dists}


# ------------------------------------------------------------------ command
def _finish(report: _Report) -> int:
    print("\n" + report.table())
    if report.failed:
        print("\npolytrain check: FAILED (see the FAIL rows above)", file=sys.stderr)
        return EXIT_FAILED
    print("\npolytrain check: all good")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """Pre-flight: Ray, resources, versions, backends importable on workers, collectives."""
    from polytrain.backends.registry import describe_backends
    from polytrain.trainer_api.options.run_config import connect_ray

    report = _Report()
    print("polytrain check", flush=True)
    try:
        connect_ray(args.address)
    except ConnectionError as exc:
        report.add("ray", "FAIL", str(exc))
        print("\n" + report.table())
        return EXIT_FAILED
    report.add("ray", "OK", ray_summary())
    # --cluster-config: the cluster file the nodes were started from (launcher YAML or
    # RayCluster manifest), read for node types when the cluster does not publish them.
    _check_nodes(report, getattr(args, "cluster_config", None))
    cpus = _check_resources(report, args.num_workers)
    _check_versions(report, args.timeout)
    requested = split_names(args.backends)
    names = requested or [spec.name for spec in describe_backends()]
    ready = _check_backends(report, names, bool(requested), args.timeout)
    if not args.no_collective:
        _check_collectives(report, ready, args.num_workers, cpus)
    return _finish(report)
