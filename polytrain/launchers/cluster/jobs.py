"""Submit a command to a running Ray cluster through the Ray Jobs API and follow it.

The working directory is uploaded with the job (Ray's ``working_dir`` runtime
env), so the cluster runs the code on the submitting machine; the job's log is
streamed back while it runs. Per-job Python packages go into Ray's ``pip`` runtime
env: each node installs them into a virtualenv of the job's own (on top of the
node's packages) before the job starts.

A cluster with Ray's token authentication (``RAY_AUTH_MODE=token`` on the head)
refuses Jobs API requests without its token. The token reaches the client from
the submitting process's environment, never from the command line (where ``ps``
would show it): ``RAY_AUTH_TOKEN`` (the token) or ``RAY_AUTH_TOKEN_PATH`` (a file
holding it), sent as ``Authorization: Bearer <token>`` on every request whether or
not ``RAY_AUTH_MODE`` is set locally. With neither, Ray's own rule applies (its
client sends ``~/.ray/auth_token`` when ``RAY_AUTH_MODE=token``). The token is never
put into the job's environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

from polytrain.errors import ConfigError

logger = logging.getLogger(__name__)

#: The environment variables the Jobs API token is read from, in this order.
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"

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


def auth_token(token: str | None = None) -> str | None:
    """The Jobs API token: ``token``, else ``$RAY_AUTH_TOKEN``, else the file ``$RAY_AUTH_TOKEN_PATH``.

    Raises:
        ConfigError: ``RAY_AUTH_TOKEN_PATH`` names a file that cannot be read or is empty.
    """
    if token and token.strip():
        return token.strip()
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip()
    path = os.environ.get(TOKEN_PATH_ENV)
    if not path:
        return None
    try:
        text = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{TOKEN_PATH_ENV}={path!r} cannot be read ({exc}). Point it at the file holding "
            f"the cluster's token (`ray get-auth-token` on the head node prints it), or unset it."
        ) from None
    if not text:
        raise ConfigError(f"{TOKEN_PATH_ENV}={path!r} is empty; it must hold the cluster's token.")
    return text


def auth_headers(token: str | None = None) -> dict[str, str]:
    """HTTP headers carrying :func:`auth_token` (empty when there is no token)."""
    value = auth_token(token)
    return {"Authorization": f"Bearer {value}"} if value else {}


def _is_plaintext_remote(address: str) -> bool:
    parsed = urlparse(address if "://" in address else f"http://{address}")
    host = (parsed.hostname or "").lower()
    return parsed.scheme == "http" and host not in ("127.0.0.1", "localhost", "::1")


def _auth_message(address: str, exc: BaseException) -> str:
    return (
        f"The Ray Jobs API at {address} refused the request: {str(exc).splitlines()[0]} "
        f"The cluster uses Ray's token authentication: export {TOKEN_ENV}=<token> (print it "
        f"with `ray get-auth-token` on the head node, e.g. `ray exec cluster.yaml "
        f"'ray get-auth-token'`) or {TOKEN_PATH_ENV}=<file holding it>, and submit again."
    )


@contextlib.contextmanager
def _auth_errors(address: str) -> Iterator[None]:
    """Turn Ray's authentication refusal into a ConnectionError that says where the token goes."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        raise ConnectionError(_auth_message(address, exc)) from None


def _client(address: str, token: str | None = None) -> Any:
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    headers = auth_headers(token)
    if headers and _is_plaintext_remote(address):
        logger.warning(
            "Sending the cluster's token to %s over plain HTTP. Forward the dashboard "
            "(`ray dashboard cluster.yaml`) and use http://127.0.0.1:8265, or use https.",
            address,
        )
    try:
        return JobSubmissionClient(address, headers=headers or None)
    except AuthenticationError as exc:
        raise ConnectionError(_auth_message(address, exc)) from None
    except Exception as exc:  # noqa: BLE001 - connection errors of several kinds
        raise ConnectionError(
            f"Could not reach the Ray Jobs API at {address!r} ({type(exc).__name__}: {exc}). "
            f"Pass the head node's dashboard address (http://<head-ip>:8265); on a cluster "
            f"started with `ray up`, forward it with `ray dashboard cluster.yaml`."
        ) from exc


def read_requirements(path: str | os.PathLike) -> list[str]:
    """The requirement lines of a pip requirements file, without blank lines and comments.

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(
            f"--requirements {str(path)!r} cannot be read ({exc}). Pass a pip requirements "
            f"file on this machine (one requirement per line)."
        ) from None
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


#: What the Jobs API answers while the head's job agent has not registered yet.
NO_AGENT = "No available agent to submit job"
#: How long a submission waits for the job agent of a head that has just started.
AGENT_WAIT_S = 60.0


def submit_job(
    address: str,
    entrypoint: str | Sequence[str],
    working_dir: str | None = ".",
    excludes: Sequence[str] = (),
    env_vars: dict[str, str] | None = None,
    submission_id: str | None = None,
    token: str | None = None,
    pip: Sequence[str] | None = None,
) -> str:
    """Submit ``entrypoint`` to the cluster; returns the job id.

    Args:
        address: the Ray dashboard / Jobs API address, e.g. ``http://127.0.0.1:8265``.
        entrypoint: the shell command, as a string or an argv list.
        working_dir: uploaded and used as the job's working directory (None: nothing).
        excludes: more gitignore-style patterns to leave out of the upload.
        env_vars: environment of the job's driver and workers.
        submission_id: a job id of your own choosing.
        token: the cluster's auth token (default: see :func:`auth_token`).
        pip: pip requirements installed for this job only (Ray's ``pip`` runtime env);
            a path in them names a file or folder on the cluster's nodes.

    Raises:
        ConnectionError: the Jobs API cannot be reached, or refused the token (or its
            absence), saying where the token goes.
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
    if pip:
        runtime_env["pip"] = list(pip)
    client = _client(address, token)
    # A head that has just started answers the Jobs API before its job agent has
    # registered ("No available agent to submit job, please try again later"): wait for
    # it, as Ray asks, instead of failing a submission the next second would accept.
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            with _auth_errors(address):
                return client.submit_job(
                    entrypoint=command, runtime_env=runtime_env or None, submission_id=submission_id
                )
        except RuntimeError as exc:
            if NO_AGENT not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def follow_job(
    address: str,
    job_id: str,
    out: TextIO | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    token: str | None = None,
) -> JobOutcome:
    """Stream the job's log to ``out`` until it ends; Ctrl-C stops the job.

    ``token``: the cluster's auth token (default: see :func:`auth_token`).

    Raises:
        TimeoutError: the job did not end within ``timeout_s`` (it is stopped).
    """
    out = out or sys.stdout
    client = _client(address, token)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _auth_errors(address):
        return _stream(client, job_id, out, poll_s, deadline, timeout_s, sleep)


def _stream(
    client: Any,
    job_id: str,
    out: TextIO,
    poll_s: float,
    deadline: float | None,
    timeout_s: float | None,
    sleep: Callable[[float], None],
) -> JobOutcome:
    from ray.job_submission import JobStatus

    printed = 0
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
    token: str | None = None,
    pip: Sequence[str] | None = None,
) -> JobOutcome:
    """Submit a job and (by default) follow it to the end.

    ``token`` is the cluster's auth token; by default it comes from ``RAY_AUTH_TOKEN``
    or ``RAY_AUTH_TOKEN_PATH`` (see :func:`auth_token`). ``pip`` lists requirements
    installed for this job only (see :func:`submit_job`).

    Example:
        >>> outcome = run_job("http://127.0.0.1:8265",
        ...                   ["polytrain", "train", "-c", "examples/configs/ddp.yaml"])
        >>> raise SystemExit(outcome.exit_code)

    Returns:
        The :class:`JobOutcome`; its ``exit_code`` is 0 only when the job SUCCEEDED.
    """
    job_id = submit_job(address, entrypoint, working_dir, excludes, env_vars, token=token, pip=pip)
    if not wait:
        return JobOutcome(job_id=job_id, status="PENDING")
    return follow_job(address, job_id, out=out, timeout_s=timeout_s, token=token)
