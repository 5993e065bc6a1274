"""The backend registry: names, aliases, errors, lazy imports."""

from __future__ import annotations

import sys

import pytest

from polytrain.backends import registry
from polytrain.backends.core.backend import Backend, BackendConfig
from polytrain.backends.registry import (
    BackendSpec,
    UnknownBackendError,
    available_backends,
    get_backend,
    resolve_backend_name,
)
from polytrain.compat.imports import MissingDependencyError
from polytrain.errors import ConfigError


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
        "polytrain.backends.ddp.backend:DDPBackend",
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


def test_every_fact_about_a_backend_comes_from_its_registry_entry():
    """Install hints, the backend suite's cases and the check rows derive from BackendSpec."""
    from polytrain.compat import imports

    for spec in registry.describe_backends():
        assert spec.test_cases, f"{spec.name} has no test cases in its registry entry"
        for module in spec.requires:
            if spec.extra:
                assert imports.install_hint(module) == spec.install_hint
    assert registry.get_spec("deepspeed").install_hint == 'pip install "polytrain[deepspeed]"'
    assert "scripts/install_horovod.sh" in registry.get_spec("hvd").install_hint
    ids = [case.id for case in registry.get_spec("deepspeed").test_cases]
    assert ids == ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


#: A no-op backend written the way the README's "Adding a backend" recipe says: one folder
#: (config, strategy, backend), one registry entry. Its strategy counts what it is asked.
RECIPE_FILES = {
    "__init__.py": '''"""The noop backend: plain torch, one process; counts the strategy's calls."""

from noop_backend.config import NoopConfig

__all__ = ["NoopConfig"]
''',
    "config.py": '''"""Options of the noop backend."""

from dataclasses import dataclass

from polytrain.backends.core.backend import BackendConfig
from polytrain.errors import ConfigError


@dataclass
class NoopConfig(BackendConfig):
    """Options of the noop backend."""

    label: str = "noop"

    def __post_init__(self) -> None:
        if not self.label:
            raise ConfigError(f"label={self.label!r} is not allowed: give a non-empty string.")
''',
    "strategy.py": '''"""The worker side of the noop backend."""

from polytrain.backends.core.strategy import TorchStrategy

CALLS = {"prepare": 0, "zero_grad": 0}


class NoopStrategy(TorchStrategy):
    """Plain torch; counts prepare and zero_grad."""

    def prepare(self, components, ctx):
        CALLS["prepare"] += 1
        return super().prepare(components, ctx)

    def zero_grad(self, components):
        CALLS["zero_grad"] += 1
        super().zero_grad(components)
''',
    "backend.py": '''"""The noop backend: its config, the no-op rendezvous and its strategy."""

from noop_backend.config import NoopConfig
from noop_backend.strategy import NoopStrategy
from polytrain.backends.core.backend import Backend
from polytrain.backends.core.rendezvous import Rendezvous


class NoopBackend(Backend):
    """One process, plain torch."""

    name = "noop"
    framework = "torch"
    config_cls = NoopConfig
    rendezvous_cls = Rendezvous
    strategy_cls = NoopStrategy
''',
}


def test_a_new_backend_is_one_folder_and_one_entry(tmp_path, monkeypatch):
    """The README's recipe, followed: a folder, one BackendSpec; it trains and obeys the floors."""
    import importlib

    from polytrain import TorchTrainer
    from tests.helpers import DIGITS
    from tests.unit.test_layering import imports_of

    folder = tmp_path / "noop_backend"
    folder.mkdir()
    for name, text in RECIPE_FILES.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The recipe's rule: config.py imports only the backend contracts and errors.
    config_imports = {m for m, _ in imports_of(RECIPE_FILES["config.py"], "noop_backend.config")}
    assert {m for m in config_imports if m.startswith("polytrain")} <= {
        "polytrain.backends.core.backend",
        "polytrain.errors",
    }
    spec = BackendSpec(
        "noop", "noop_backend.backend:NoopBackend", "torch", "plain torch", aliases=("nop",)
    )
    registry.register_backend(spec)
    try:
        with pytest.raises(ConfigError, match="label=''"):
            get_backend("nop", {"label": ""})
        trainer = TorchTrainer(
            **DIGITS,
            config={"batch_size": 32},
            num_workers=0,
            backend="nop",
            backend_config={"label": "x"},
        )
        stats = trainer.train(num_steps=3)
        trainer.shutdown()
        calls = importlib.import_module("noop_backend.strategy").CALLS
        assert stats["num_steps"] == 3 and calls == {"prepare": 1, "zero_grad": 3}
        assert "noop" in registry.available_backends()
    finally:
        registry._SPECS.pop("noop")
        registry._ALIASES.pop("noop")
        registry._ALIASES.pop("nop")
        for name in [m for m in sys.modules if m.startswith("noop_backend")]:
            sys.modules.pop(name)


def test_registry_errors_are_polytrain_errors():
    from polytrain.errors import ConfigError, PolytrainError

    assert issubclass(UnknownBackendError, ConfigError)
    assert issubclass(MissingDependencyError, PolytrainError)
    assert issubclass(MissingDependencyError, ImportError)


def test_raysgd_gloo_and_nccl_are_ddp_with_that_process_group_backend():
    assert resolve_backend_name("gloo") == "ddp" and resolve_backend_name("NCCL") == "ddp"
    assert get_backend("gloo").config.dist_backend == "gloo"
    assert get_backend("nccl").config.dist_backend == "nccl"
    assert get_backend("gloo", {"static_graph": True}).config.static_graph is True
    with pytest.raises(ValueError, match="backend='gloo' means backend 'ddp'.*dist_backend"):
        get_backend("gloo", {"dist_backend": "nccl"})
    with pytest.raises(UnknownBackendError) as info:
        resolve_backend_name("mpi")
    assert "gloo = ddp with {'dist_backend': 'gloo'}" in str(info.value)
