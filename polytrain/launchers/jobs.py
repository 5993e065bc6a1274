"""Submit a command to a running Ray cluster through the Ray Jobs API and follow it.

The working directory is uploaded with the job (Ray's ``working_dir`` runtime
env), so the cluster runs the code on the submitting machine; the job's log is
streamed back while it runs.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from polytrain.errors import ConfigError

#: Never uploaded with the working directory: environments, VCS data, run outputs.
DEFAULT_EXCLUDES = (
    ".venv",
    "venv",
    ".env",
    ".git",
    ".hg",
    "**/__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "*.egg-info",
    "build",
    "dist",
    "node_modules",
    "polytrain_runs",
    "lightning_logs",
    "wandb",
    "*.pt",
    "*.ckpt",
)

#: Terminal job states and the exit status the submitter returns for each.
EXIT_STATUS = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 2}


@dataclass
class JobOutcome:
    """The end of a submitted job.

    Attributes:
        job_id: the submission id.
        status: "SUCCEEDED", "FAILED", "STOPPED" (or "PENDING"/"RUNNING" when not waited for).
        message: Ray's status message (e.g. the entrypoint's exit code).
        logs: the job's whole log.
    """

    job_id: str
    status: str
    message: str = ""
    logs: str = ""

    @property
    def exit_code(self) -> int:
        """0 for SUCCEEDED (or not waited for), non-zero for FAILED / STOPPED."""
        return EXIT_STATUS.get(self.status, 0)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.logs.rstrip().splitlines()[-lines:])


def _client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - connection errors of several kinds
        raise ConnectionError(
            f"Could not reach the Ray Jobs API at {address!r} ({type(exc).__name__}: {exc}). "
            f"Pass the head node's dashboard address (http://<head-ip>:8265); on a cluster "
            f"started with `ray up`, forward it with `ray dashboard cluster.yaml`."
        ) from exc


def submit_job(
    address: str,
    entrypoint: str | Sequence[str],
    working_dir: str | None = ".",
    excludes: Sequence[str] = (),
    env_vars: dict[str, str] | None = None,
    submission_id: str | None = None,
) -> str:
    """Submit ``entrypoint`` to the cluster; returns the job id.

    Args:
        address: the Ray dashboard / Jobs API address, e.g. ``http://127.0.0.1:8265``.
        entrypoint: the shell command, as a string or an argv list.
        working_dir: uploaded and used as the job's working directory (None: nothing).
        excludes: more gitignore-style patterns to leave out of the upload.
        env_vars: environment of the job's driver and workers.
        submission_id: a job id of your own choosing.
    """
    command = entrypoint if isinstance(entrypoint, str) else shlex.join(entrypoint)
    if not command.strip():
        raise ConfigError("The job's command is empty; pass it after `--`.")
    runtime_env: dict[str, Any] = {}
    if working_dir is not None:
        directory = Path(working_dir).expanduser().resolve()
        if not directory.is_dir():
            raise FileNotFoundError(f"working_dir {str(directory)!r} is not a directory.")
        runtime_env["working_dir"] = str(directory)
        runtime_env["excludes"] = [*DEFAULT_EXCLUDES, *excludes]
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return _client(address).submit_job(
        entrypoint=command, runtime_env=runtime_env or None, submission_id=submission_id
    )


def follow_job(
    address: str,
    job_id: str,
    out: TextIO | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> JobOutcome:
    """Stream the job's log to ``out`` until it ends; Ctrl-C stops the job.

    Raises:
        TimeoutError: the job did not end within ``timeout_s`` (it is stopped).
    """
    from ray.job_submission import JobStatus

    out = out or sys.stdout
    client = _client(address)
    printed = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            status = client.get_job_status(job_id)
            logs = client.get_job_logs(job_id)
            if len(logs) > printed:
                out.write(logs[printed:])
                out.flush()
                printed = len(logs)
            if status.is_terminal():
                break
            if deadline is not None and time.monotonic() > deadline:
                client.stop_job(job_id)
                raise TimeoutError(f"Job {job_id} ran past {timeout_s:g} s and was stopped.")
            sleep(poll_s)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        raise
    info = client.get_job_info(job_id)
    logs = client.get_job_logs(job_id)
    if len(logs) > printed:
        out.write(logs[printed:])
        out.flush()
    return JobOutcome(
        job_id=job_id,
        status=str(JobStatus(info.status).value),
        message=info.message or "",
        logs=logs,
    )


def run_job(
    address: str,
    entrypoint: str | Sequence[str],
    working_dir: str | None = ".",
    excludes: Sequence[str] = (),
    env_vars: dict[str, str] | None = None,
    wait: bool = True,
    out: TextIO | None = None,
    timeout_s: float | None = None,
) -> JobOutcome:
    """Submit a job and (by default) follow it to the end.

    Example:
        >>> outcome = run_job("http://127.0.0.1:8265",
        ...                   ["polytrain", "train", "-c", "examples/configs/ddp.yaml"])
        >>> raise SystemExit(outcome.exit_code)

    Returns:
        The :class:`JobOutcome`; its ``exit_code`` is 0 only when the job SUCCEEDED.
    """
    job_id = submit_job(address, entrypoint, working_dir, excludes, env_vars)
    if not wait:
        return JobOutcome(job_id=job_id, status="PENDING")
    return follow_job(address, job_id, out=out, timeout_s=timeout_s)
