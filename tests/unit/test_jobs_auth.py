"""Where `polytrain submit` takes the cluster's token from (issue 17, point 5), without a cluster."""

from __future__ import annotations

import pytest

from polytrain.errors import ConfigError
from polytrain.launchers.cluster import jobs
from polytrain.launchers.cluster.jobs import _is_plaintext_remote, auth_headers, auth_token


@pytest.fixture
def no_token_env(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    return monkeypatch


def test_no_token_anywhere_sends_no_header(no_token_env):
    assert auth_token() is None
    assert auth_headers() == {}


def test_token_from_the_environment(no_token_env):
    no_token_env.setenv("RAY_AUTH_TOKEN", " abc123\n")
    assert auth_headers() == {"Authorization": "Bearer abc123"}


def test_token_from_a_file(no_token_env, tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    no_token_env.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    assert auth_headers() == {"Authorization": "Bearer from-file"}


def test_precedence_argument_then_variable_then_file(no_token_env, tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file")
    no_token_env.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    no_token_env.setenv("RAY_AUTH_TOKEN", "from-env")
    assert auth_token("given") == "given"
    assert auth_token() == "from-env"


def test_unreadable_or_empty_token_file_is_a_config_error(no_token_env, tmp_path):
    no_token_env.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="RAY_AUTH_TOKEN_PATH=.*missing.*cannot be read"):
        auth_token()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    no_token_env.setenv("RAY_AUTH_TOKEN_PATH", str(empty))
    with pytest.raises(ConfigError, match="is empty"):
        auth_token()


@pytest.mark.parametrize(
    ("address", "plaintext_remote"),
    [
        ("http://127.0.0.1:8265", False),
        ("http://localhost:8265", False),
        ("https://head.example.com:8265", False),
        ("http://10.0.0.5:8265", True),
        ("10.0.0.5:8265", True),
    ],
)
def test_token_over_plain_http_to_another_host_is_flagged(address, plaintext_remote):
    assert _is_plaintext_remote(address) is plaintext_remote


class _AgentLater:
    """A Jobs API client whose head's job agent registers after ``busy`` answers."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.calls = 0

    def submit_job(self, **kwargs):
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError(
                "Request failed with status code 500: No available agent to submit job, "
                "please try again later.."
            )
        return "raysubmit_1"


def test_submission_waits_for_the_job_agent_of_a_head_that_just_started(monkeypatch):
    client = _AgentLater(busy=2)
    monkeypatch.setattr(jobs, "_client", lambda address, token=None: client)
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    assert jobs.submit_job("http://127.0.0.1:8265", "echo hi") == "raysubmit_1"
    assert client.calls == 3


def test_other_submission_errors_are_not_retried(monkeypatch):
    class Broken:
        calls = 0

        def submit_job(self, **kwargs):
            Broken.calls += 1
            raise RuntimeError("Request failed with status code 400: bad runtime_env")

    monkeypatch.setattr(jobs, "_client", lambda address, token=None: Broken())
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        jobs.submit_job("http://127.0.0.1:8265", "echo hi")
    assert Broken.calls == 1
