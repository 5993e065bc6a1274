"""One malloc arena in torch workers (issue 42): who asks for it, and whose value wins."""

from __future__ import annotations

import pytest

from polytrain.backends.registry import available_backends, get_backend
from polytrain.launchers.process_env import (
    ARENA_MAX_ENV,
    resolve_process_env,
    single_arena_env,
)
from polytrain.train.backend import BackendConfig, with_user_backend


@pytest.fixture(autouse=True)
def _no_driver_value(monkeypatch):
    monkeypatch.delenv(ARENA_MAX_ENV, raising=False)


@pytest.mark.parametrize("name", available_backends("torch", installed_only=False))
def test_every_torch_backend_starts_its_workers_with_one_arena(name):
    assert get_backend(name).make_rendezvous().worker_process_env() == {ARENA_MAX_ENV: "1"}


def test_tensorflow_workers_keep_glibcs_default():
    # TF's ops allocate on TF's own thread pools under MWMS and under a plain TF_CONFIG
    # launch alike: nothing to match, and one arena would serialise those threads.
    assert get_backend("mwms").make_rendezvous().worker_process_env() == {}


def test_a_user_backend_keeps_the_backends_process_env():
    rendezvous = with_user_backend(get_backend("ddp"), BackendConfig()).make_rendezvous()
    assert rendezvous.worker_process_env() == {ARENA_MAX_ENV: "1"}


def test_the_requested_value_without_a_user_value():
    assert resolve_process_env(single_arena_env(), {}) == {ARENA_MAX_ENV: "1"}


def test_the_drivers_value_travels_to_the_workers(monkeypatch):
    monkeypatch.setenv(ARENA_MAX_ENV, "4")
    assert resolve_process_env(single_arena_env(), {}) == {ARENA_MAX_ENV: "4"}


def test_a_value_in_the_jobs_runtime_env_is_left_to_ray(monkeypatch):
    monkeypatch.setenv(ARENA_MAX_ENV, "4")  # the job's runtime_env wins over the driver's too
    assert resolve_process_env(single_arena_env(), {ARENA_MAX_ENV: "2", "OTHER": "x"}) == {}
