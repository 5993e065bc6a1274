"""Warm-pool settings and the reset's module classification, without Ray (issue 14)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.launchers.pool import reset as worker_reset
from polytrain.launchers.pool import warm_pool as pool


@pytest.fixture(autouse=True)
def default_settings():
    pool.reset_settings()
    yield
    pool.reset_settings()


def test_defaults_bound_the_pool():
    settings = pool.get_settings()
    assert settings.enabled and settings.max_idle > 0 and settings.idle_timeout_s > 0
    assert settings.preload is None  # each backend's own modules


def test_configure_changes_only_what_it_is_given():
    settings = pool.configure(max_idle=3, preload=["torch", "torch._dynamo"])
    assert settings.max_idle == 3 and settings.preload == ("torch", "torch._dynamo")
    assert pool.configure(idle_timeout_s=5).max_idle == 3
    assert pool.get_settings().idle_timeout_s == 5


def test_configure_rejects_bad_values_naming_them():
    with pytest.raises(ConfigError, match="max_idle must be >= 0; got -1"):
        pool.configure(max_idle=-1)
    with pytest.raises(ConfigTypeError, match="idle_timeout_s.*'long'"):
        pool.configure(idle_timeout_s="long")
    with pytest.raises(ConfigTypeError, match="enabled must be True or False; got 'yes'"):
        pool.configure(enabled="yes")
    with pytest.raises(ConfigTypeError, match="preload must be a sequence of module names"):
        pool.configure(preload="torch")
    assert pool.get_settings() == pool.PoolSettings()  # nothing changed


def test_environment_sets_bounds_and_switches_off(monkeypatch):
    monkeypatch.setenv(pool.ENV_MAX_IDLE, "4")
    monkeypatch.setenv(pool.ENV_IDLE_TIMEOUT, "2.5")
    monkeypatch.setenv("POLYTRAIN_PRELOAD", "torch, torch._dynamo")
    pool.reset_settings()
    settings = pool.get_settings()
    assert (settings.max_idle, settings.idle_timeout_s) == (4, 2.5)
    assert settings.preload == ("torch", "torch._dynamo")
    assert pool.is_enabled()
    monkeypatch.setenv(pool.ENV_SWITCH, "0")
    assert not pool.is_enabled()


@pytest.mark.parametrize("value", ["none", "off", "0"])
def test_environment_turns_pre_imports_off(monkeypatch, value):
    monkeypatch.setenv("POLYTRAIN_PRELOAD", value)
    pool.reset_settings()
    assert pool.get_settings().preload == ()


def test_each_torch_backend_pre_imports_its_own_library():
    from polytrain.backends.registry import get_backend

    expected = {
        "ddp": "torch._dynamo",
        "horovod": "horovod.torch",
        "fairscale": "fairscale",
        "fsdp": "torch.distributed.fsdp",
        "deepspeed": "deepspeed",
    }
    for name, library in expected.items():
        modules = get_backend(name).preload_modules
        assert modules[:2] == ("torch", "torch.distributed") and library in modules, name
    assert get_backend("mwms").preload_modules == ()  # imported once TF_CONFIG is set


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(pool.ENV_MAX_IDLE, "many")
    pool.reset_settings()
    with pytest.raises(ConfigError, match="POLYTRAIN_WARM_POOL_MAX_IDLE='many' is not a number"):
        pool.get_settings()


def _module(name: str, path: str | None) -> types.ModuleType:
    module = types.ModuleType(name)
    if path is not None:
        module.__file__ = path
    return module


def test_user_modules_are_told_from_libraries(tmp_path):
    roots = worker_reset._library_roots()
    library = os.path.join(os.path.dirname(os.__file__), "json", "__init__.py")
    assert worker_reset.is_user_module("mymodel", _module("mymodel", str(tmp_path / "m.py")), roots)
    assert not worker_reset.is_user_module("json", _module("json", library), roots)
    assert not worker_reset.is_user_module("torch", sys.modules.get("torch") or sys, roots)
    # polytrain itself, the main script, extension and built-in modules always stay.
    here = str(tmp_path / "x.py")
    assert not worker_reset.is_user_module("polytrain.x", _module("polytrain.x", here), roots)
    assert not worker_reset.is_user_module("__main__", _module("__main__", here), roots)
    ext = str(tmp_path / "fast.cpython-311-x86_64-linux-gnu.so")
    assert not worker_reset.is_user_module("fast", _module("fast", ext), roots)
    assert not worker_reset.is_user_module("builtin", _module("builtin", None), roots)


def test_polytrain_pool_is_an_attribute_and_imports_neither_ray_nor_torch():
    code = (
        "import sys, polytrain\n"
        "polytrain.pool.configure(idle_timeout_s=5)\n"
        "assert polytrain.pool.get_settings().idle_timeout_s == 5\n"
        "assert 'pool' in dir(polytrain)\n"
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
