"""Importing a run config's creators, on the driver and on Ray's workers.

A run config names its creators by import path (``examples.digits:model_creator``),
relative to the current directory. These helpers import them on the driver with
messages that name the config key, and make sure Ray's workers can import them too.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

__all__ = [
    "connect_ray",
    "import_object",
    "make_importable_on_workers",
    "put_cwd_on_path",
    "worker_runtime_env",
]


def put_cwd_on_path() -> str:
    """Put the current directory first on ``sys.path`` (once); returns it."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def import_object(path: str, key: str = "import path") -> Any:
    """Import ``package.module:attr`` (or ``package.module.attr``).

    Args:
        path: the import path.
        key: the config key it came from, for messages.

    Raises:
        ConfigError: naming the config key, the path and why it failed.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{key}: {path!r} is not an import path; write 'package.module:attribute'."
        )
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}: cannot import module '{module_name}' of {path!r} ({type(exc).__name__}: "
            f"{exc}). Paths resolve relative to the current directory ({os.getcwd()}) and "
            f"sys.path; run from your project root or install the package."
        ) from exc
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            names = [n for n in dir(value) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"{key}: '{module_name}' has no attribute '{attr}' (from {path!r}).{hint}"
            ) from None
    return value


def worker_runtime_env() -> dict[str, Any] | None:
    """A Ray runtime_env that lets workers import the creators' modules from the cwd.

    It also makes every worker quiet (or verbose) like the driver: the quiet
    filters run as the workers' setup hook, with the environment of
    :func:`polytrain.compat.quiet.worker_env`. Inside a Ray job whose runtime_env
    ships a working_dir or py_modules, the workers can import the modules already
    and the job's runtime_env is left alone.
    """
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from polytrain.compat import quiet

    job = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if job:
        job_env = (json.loads(job).get("runtime_env") or {}) if job else {}
        if job_env.get("working_dir") or job_env.get("py_modules"):
            return None
        if "PYTHONPATH" in (job_env.get("env_vars") or {}):
            return None  # merging would conflict; the job chose its own path
    paths = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        "env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **quiet.worker_env()},
        "worker_process_setup_hook": f"{quiet.__name__}.install",
    }


def connect_ray(address: str | None = None) -> None:
    """Connect to Ray (the running instance, ``address``, or a new local one).

    Like :func:`polytrain.launchers.worker_group.ensure_ray`, and in addition the
    workers get the current directory on their ``PYTHONPATH``, so creators given as
    import paths relative to it (``examples.digits:model_creator``) load there too.
    Does nothing when Ray is already initialized.
    """
    from polytrain.launchers.worker_group import ensure_ray

    ensure_ray(address, runtime_env=worker_runtime_env())


def make_importable_on_workers(objects: Iterable[Any]) -> None:
    """Ship creators from cwd modules by value when Ray's workers cannot import them.

    A Ray instance started elsewhere (``ray.init()`` in a notebook) may not have the
    current directory on its workers' path; cloudpickle then sends those modules'
    code along instead of a reference.
    """
    import ray
    from ray import cloudpickle

    cwd = os.getcwd()
    env = ray.get_runtime_context().runtime_env or {}
    worker_paths = (env.get("env_vars") or {}).get("PYTHONPATH", "").split(os.pathsep)
    if env.get("working_dir") or env.get("py_modules") or cwd in worker_paths:
        return
    installed = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)]
    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        file = Path(getattr(module, "__file__", None) or "/").resolve()
        root = (module.__name__ if module else "").split(".")[0]
        if (
            root
            and root != "polytrain"
            and file.is_relative_to(Path(cwd).resolve())
            and not any(file.is_relative_to(p) for p in installed)
        ):
            try:
                cloudpickle.register_pickle_by_value(sys.modules[root])
            except ValueError:  # pragma: no cover - already registered
                pass
