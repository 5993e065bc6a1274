"""Quiet by default (issue 16.4): which warnings and log records are filtered, and --verbose.

The end-to-end check (a real `polytrain compare` over the noisy backends) is in
tests/integration/test_quiet.py; here the filters run in this process on
warnings raised from code that lives in modules named like the frameworks'.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import typing_extensions

from polytrain.compat import quiet

REPO_ROOT = Path(__file__).resolve().parents[2]


def _function_in_module(module: str, source: str, name: str, **globals_):
    """A function whose frames report ``module`` as their module (as a framework's would)."""
    namespace = {"__name__": module, "warnings": warnings, **globals_}
    exec(compile(source, f"<{module}>", "exec"), namespace)  # noqa: S102 - test fixture code
    return namespace[name]


# torch deprecates collectives with typing_extensions.deprecated, and torch.distributed's
# c10d_logger wraps them: the warning is raised two library frames below the caller.
torch_deprecated = _function_in_module(
    "torch.distributed.distributed_c10d",
    "@deprecated('all_gather_into_tensor is deprecated', category=FutureWarning)\n"
    "def all_gather_into_tensor():\n    return 1\n",
    "all_gather_into_tensor",
    deprecated=typing_extensions.deprecated,
)
torch_wrapper = _function_in_module(
    "torch.distributed.c10d_logger",
    "def wrapper(*args, **kwargs):\n    return func(*args, **kwargs)\n",
    "wrapper",
    func=torch_deprecated,
)
deepspeed_code = _function_in_module(
    "deepspeed.comm.torch",
    "def all_gather():\n    return collective()\n",
    "all_gather",
    collective=torch_wrapper,
)
user_code = _function_in_module(
    "my_project.train",
    "def step():\n    return collective()\n",
    "step",
    collective=torch_wrapper,
)
keras_code = _function_in_module(
    "tf_keras.src.engine",
    "def fit():\n    warnings.warn('keras internal notice', UserWarning)\n",
    "fit",
)


@pytest.fixture
def quiet_filters(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet.install()
        try:
            yield shown  # what passed the filter
        finally:
            quiet.uninstall()


def test_framework_warnings_are_dropped_and_the_users_kept(quiet_filters, monkeypatch):
    deepspeed_code()  # DeepSpeed's use of a deprecated torch API: not the user's to fix
    keras_code()
    user_code()  # the user's own use of it: shown
    assert [(str(w.message), w.category) for w in quiet_filters] == [
        ("all_gather_into_tensor is deprecated", FutureWarning)
    ]
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")  # checked when the warning is shown
    deepspeed_code()
    assert str(quiet_filters[-1].message) == "all_gather_into_tensor is deprecated"


def _records(logger: logging.Logger, *messages: str) -> list[str]:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for message in messages:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def test_known_framework_log_records_are_dropped(quiet_filters, monkeypatch):
    deepspeed_logger = logging.getLogger("DeepSpeed")
    assert _records(
        deepspeed_logger,
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to "
        "detect it.",
        "**** You are using ZeRO with an untested optimizer, proceed with caution *****",
        "zero stage 3 needs more memory",  # not a known notice: kept
    ) == ["zero stage 3 needs more memory"]
    # fairscale logs on the root logger at every train/eval switch
    root = logging.getLogger()
    assert _records(root, "ShardedDDP detected that the trainable params changed, either") == []
    assert _records(root, "a warning of the user's") == ["a warning of the user's"]
    monkeypatch.setenv(quiet.VERBOSE_ENV, "true")
    assert _records(deepspeed_logger, "Setting accelerator to CPU.") == [
        "Setting accelerator to CPU."
    ]


def test_verbose_installs_nothing_and_worker_env_follows(monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    with warnings.catch_warnings():
        quiet.install()
        assert warnings.showwarning is not quiet._quiet_showwarning
    assert quiet.worker_env() == {quiet.VERBOSE_ENV: "1"}
    monkeypatch.delenv(quiet.VERBOSE_ENV)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert quiet.worker_env() == {"TF_CPP_MIN_LOG_LEVEL": "3"}
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # the user's own choice wins
    assert quiet.worker_env() == {"TF_CPP_MIN_LOG_LEVEL": "1"}


@pytest.mark.parametrize("verbose", [False, True])
def test_tensorflow_import_lines_are_held_back_unless_verbose(verbose):
    env = {
        k: v for k, v in os.environ.items() if k not in (quiet.VERBOSE_ENV, "TF_CPP_MIN_LOG_LEVEL")
    }
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    code = "from polytrain.compat.quiet import quiet_import_tensorflow as q; print(q().__name__)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tensorflow"
    assert ("absl::InitializeLog" in proc.stderr) is verbose, proc.stderr
