"""The backend registry: names, aliases, errors, lazy imports."""

from __future__ import annotations

import pytest

from polytrain.backends import registry
from polytrain.backends.base import Backend, BackendConfig
from polytrain.backends.registry import (
    BackendSpec,
    UnknownBackendError,
    available_backends,
    get_backend,
    resolve_backend_name,
)
from polytrain.compat.imports import MissingDependencyError


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("torch", "ddp"),
        ("DDP", "ddp"),
        ("hvd", "horovod"),
        ("ds", "deepspeed"),
        ("sharded", "fairscale"),
        ("torch_fsdp", "fsdp"),
        ("tf", "mwms"),
        ("tensorflow", "mwms"),
    ],
)
def test_aliases_resolve(alias, name):
    assert resolve_backend_name(alias) == name


def test_unknown_name_repeats_value_and_lists_every_valid_name():
    with pytest.raises(UnknownBackendError) as info:
        resolve_backend_name("horovood")
    message = str(info.value)
    assert "'horovood'" in message
    for name in ("ddp", "horovod", "fairscale", "fsdp", "deepspeed", "mwms"):
        assert f"'{name}'" in message


def test_non_string_backend_is_rejected():
    with pytest.raises(UnknownBackendError, match="must be a name"):
        resolve_backend_name(3)


def test_wrong_framework_points_to_the_other_trainer():
    with pytest.raises(UnknownBackendError, match="'mwms' is a tensorflow backend.*Use TFTrainer"):
        registry.get_backend_class("mwms", framework="torch")
    with pytest.raises(UnknownBackendError, match="Use TorchTrainer"):
        registry.get_backend_class("ddp", framework="tensorflow")


@pytest.fixture
def fake_backend():
    spec = BackendSpec(
        "needs_missing",
        "polytrain.backends.ddp:DDPBackend",
        "torch",
        "a backend whose package is absent",
        requires=("package_that_is_not_installed",),
    )
    registry.register_backend(spec)
    yield spec
    registry._SPECS.pop(spec.name)
    registry._ALIASES.pop(spec.name)


def test_missing_package_says_what_to_install(fake_backend):
    assert "needs_missing" not in available_backends()
    assert "needs_missing" in available_backends(installed_only=False)
    with pytest.raises(MissingDependencyError, match="pip install package_that_is_not_installed"):
        get_backend("needs_missing")


def test_horovod_hint_names_the_build_script(monkeypatch):
    from polytrain.compat import imports

    assert "scripts/install_horovod.sh" in imports.install_hint("horovod.torch")
    assert imports.install_hint("deepspeed") == 'pip install "polytrain[deepspeed]"'


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend(BackendSpec("hvd", "x:y", "torch", "dup"))


def test_backend_instances_pass_through_and_config_dicts_are_typed():
    ddp = get_backend("ddp", {"find_unused_parameters": True})
    assert ddp.config.find_unused_parameters is True
    assert get_backend(ddp) is ddp
    with pytest.raises(ValueError, match="together with a Backend instance"):
        get_backend(ddp, {"static_graph": True})
    with pytest.raises(
        TypeError, match=r"Unknown backend_config key\(s\) \['bogus'\].*Allowed keys"
    ):
        get_backend("ddp", {"bogus": 1})
    with pytest.raises(ValueError, match="dist_backend .*'mpi'.* Must be either 'gloo', 'nccl'"):
        get_backend("ddp", {"dist_backend": "mpi"})


def test_custom_backend_instance_is_accepted():
    class NoOp(Backend):
        name = "noop"
        config_cls = BackendConfig

        def prepare(self, components, ctx):
            return components

    backend = NoOp()
    assert get_backend(backend, framework="torch") is backend
