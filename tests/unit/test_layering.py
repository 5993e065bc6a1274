"""The package's boundaries: import floors, no import circles, one exception root, sizes.

The import and size checks read the source with :mod:`ast`, so they see every
import (also those inside functions and under ``TYPE_CHECKING``, and
``importlib.import_module("polytrain...")`` with a literal name) without
importing any framework. The floors, bottom to top::

    errors, compat            the ground floor: import nothing above themselves
    checkpoint                the on-disk checkpoint format: errors and compat only
    hf                        pretrained HF weights, PEFT adapters, HF / PEFT export: know
                              no launcher, backend or trainer (hf.data excepted, below)
    launchers                 Ray / local worker groups: know no backend and no trainer
    backends                  core/ (the contracts) and one folder per backend, which
                              imports no other backend's folder
    runs                      the one run loop: groups, calls, watches, policies (no front end)
    trainer_api               the trainers and what they run on the workers
    lightning, tune, train,   integrations built on the trainers and backends (train: the
    hf.data                   function API, Ray Train's ``ray.train``; hf.data: instruction
                              data and its token-mean operator)
    __init__, __main__, cli, compare   the faces: nothing below them imports them

No module imports itself back through a chain of imports (an import circle),
counting the lazy ones: a package's ``__init__`` is not counted as imported by
its submodules (Python runs it first, but no code of a submodule depends on it).
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import textwrap
import tokenize
from collections.abc import Collection
from functools import cache
from pathlib import Path

import pytest

from polytrain.errors import ConfigError, ConfigTypeError

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "polytrain"

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60

#: Files ("polytrain/x.py") or functions ("polytrain/x.py::Class.method") allowed to be
#: longer than the limits (a module is one concern of up to ~800 lines; a function fits
#: on a screen), each with the reason it reads better in one piece.
#: Empty: every module and function fits.
SIZE_EXCEPTIONS: dict[str, str] = {}


# ------------------------------------------------------------------ reading
def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve_from(module: str, is_package: bool, target: str | None, level: int) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def imports_of(
    source: str, module: str, is_package: bool = False, modules: Collection[str] | None = None
) -> list[tuple[str, int]]:
    """Every module that ``source`` imports, as (absolute name, line), in any scope.

    ``from a.b import c`` yields ``a.b.c`` when that is one of ``modules`` (default:
    the package's), else ``a.b``; ``importlib.import_module("a.b")`` with a literal
    name yields ``a.b``.
    """
    known = _package_modules() if modules is None else modules
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.module, node.level)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((first.value, node.lineno))
    return found


@cache
def _polytrain_imports() -> dict[str, list[tuple[str, int]]]:
    """Package module -> the polytrain modules it imports (with line numbers)."""
    result = {}
    for name, path in _package_modules().items():
        found = imports_of(path.read_text(), name, path.name == "__init__.py")
        result[name] = [(m, line) for m, line in dict.fromkeys(found) if _in_layer(m, "polytrain")]
    return result


def _in_layer(module: str, layer: str) -> bool:
    """``module`` is ``layer`` or inside it."""
    return module == layer or module.startswith(layer + ".")


#: Sub-packages on a higher floor than the package around them: instruction data
#: (``hf.data``) builds on the trainer's operator, the rest of ``hf`` sits below backends.
HIGHER_FLOORS = {"polytrain.hf": "polytrain.hf.data"}


def _violations(importers: str, forbidden: tuple[str, ...]) -> list[str]:
    higher = HIGHER_FLOORS.get(importers)
    return [
        f"{module} imports {target} (line {line})"
        for module, targets in _polytrain_imports().items()
        if _in_layer(module, importers) and not (higher and _in_layer(module, higher))
        for target, line in targets
        if any(_in_layer(target, layer) for layer in forbidden)
    ]


# ------------------------------------------------------------------ layers
CLI = "polytrain.cli"


def _is_face(module: str) -> bool:
    return module in ("polytrain", "polytrain.__main__") or any(
        _in_layer(module, face) for face in (CLI, "polytrain.compare.runner")
    )


LAYER_RULES = {
    "polytrain.checkpoint": (
        "polytrain.hf",
        "polytrain.launchers",
        "polytrain.runs",
        "polytrain.backends",
        "polytrain.trainer_api",
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        CLI,
        "polytrain.compare",
    ),
    "polytrain.hf": (
        "polytrain.launchers",
        "polytrain.runs",
        "polytrain.backends",
        "polytrain.trainer_api",
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        "polytrain.hf.data",
        CLI,
        "polytrain.compare",
    ),
    "polytrain.launchers": (
        "polytrain.hf",
        "polytrain.runs",
        "polytrain.trainer_api",
        "polytrain.backends",
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        CLI,
        "polytrain.compare",
    ),
    "polytrain.runs": (
        "polytrain.trainer_api",
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        CLI,
        "polytrain.compare",
    ),
    "polytrain.trainer_api": (
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        "polytrain.hf.data",
        CLI,
        "polytrain.compare.runner",
    ),
    "polytrain.backends": (
        "polytrain.runs",
        "polytrain.trainer_api",
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        "polytrain.hf.data",
        CLI,
        "polytrain.compare",
    ),
    "polytrain.hf.data": (
        "polytrain.lightning",
        "polytrain.tune",
        "polytrain.train",
        CLI,
        "polytrain.compare",
    ),
}


def test_import_reader_sees_every_kind_of_import():
    source = textwrap.dedent(
        """
        import polytrain.errors
        from polytrain import compat
        from . import worker
        from ..backends.registry import get_spec

        def f():
            import importlib
            from polytrain.checkpoint import single_file as checkpoint
            return importlib.import_module("polytrain.tune")
        """
    )
    found = {m for m, _ in imports_of(source, "polytrain.launchers.local")}
    assert "polytrain" not in found  # `from polytrain import compat` imports the module
    assert {
        "polytrain.errors",
        "polytrain.compat",
        "polytrain.launchers.worker",
        "polytrain.backends.registry",
        "polytrain.checkpoint.single_file",
        "polytrain.tune",
    } <= found
    assert len(_package_modules()) > 30 and "polytrain.cli.main" in _package_modules()


@pytest.mark.parametrize("importers", sorted(LAYER_RULES))
def test_layer_imports_nothing_above_it(importers):
    assert _violations(importers, LAYER_RULES[importers]) == []


@pytest.mark.parametrize("ground", ["polytrain.compat", "polytrain.errors"])
def test_ground_floor_imports_only_the_ground_floor(ground):
    allowed = ("polytrain.errors", "polytrain.compat")
    bad = [
        f"{module} imports {target} (line {line})"
        for module, targets in _polytrain_imports().items()
        if _in_layer(module, ground)
        for target, line in targets
        if not any(_in_layer(target, layer) for layer in allowed)
    ]
    assert bad == []


def test_only_the_faces_import_the_cli():
    bad = [
        f"{module} imports {target} (line {line})"
        for module, targets in _polytrain_imports().items()
        if not _is_face(module)
        for target, line in targets
        if _in_layer(target, CLI)
    ]
    assert bad == []


BACKEND_FOLDERS = sorted(
    p.parent.name for p in (PACKAGE / "backends").glob("*/__init__.py") if p.parent.name != "core"
)


def test_every_backend_has_its_own_folder():
    assert {"ddp", "horovod", "fairscale", "fsdp", "deepspeed", "tensorflow"} <= set(
        BACKEND_FOLDERS
    )
    flat = sorted(p.name for p in (PACKAGE / "backends").glob("*.py") if p.name != "__init__.py")
    assert flat == ["registry.py"], "a backend's modules belong in its folder"


@pytest.mark.parametrize("backend", BACKEND_FOLDERS)
def test_a_backend_folder_imports_no_other_backend(backend):
    own = f"polytrain.backends.{backend}"
    others = [f"polytrain.backends.{b}" for b in BACKEND_FOLDERS if b != backend]
    assert _violations(own, (*others, "polytrain.backends.registry")) == []


@pytest.mark.parametrize("backend", BACKEND_FOLDERS)
def test_a_backend_config_imports_only_the_contracts_and_errors(backend):
    config = f"polytrain.backends.{backend}.config"
    allowed = ("polytrain.backends.core", "polytrain.errors", "polytrain.compat")
    bad = [
        f"{config} imports {target} (line {line})"
        for target, line in _polytrain_imports().get(config, [])
        if not any(_in_layer(target, layer) for layer in allowed)
    ]
    assert bad == []


def test_launchers_name_no_backend_in_code():
    """A backend's per-process clean-up is its own reset hook, not a branch in launchers/."""
    backend_words = ("horovod", "hvd", "deepspeed", "fairscale", "fsdp", "mwms")
    found = []
    for path in sorted((PACKAGE / "launchers").rglob("*.py")):
        source = path.read_text()
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.NAME and any(
                w in token.string.lower() for w in backend_words
            ):
                found.append(f"{path.relative_to(REPO_ROOT)}:{token.start[0]} {token.string}")
    assert found == []


def import_circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_circle_finder_sees_a_lazy_circle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": ["b"], "b": []}) == []


def test_no_import_circles():
    modules = _package_modules()
    graph = {
        module: sorted({target for target, _ in targets if target in modules and target != module})
        for module, targets in _polytrain_imports().items()
    }
    assert import_circles(graph) == []


# --------------------------------------------------------------- exceptions
_EXCEPTION_SCAN = """
import importlib, inspect, json, pkgutil
import polytrain
from polytrain.errors import PolytrainError

def classes(owner, prefix):
    for name, obj in vars(owner).items():
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and obj.__qualname__ == prefix + name:
            yield obj
            yield from classes(obj, prefix + name + ".")

report = {"checked": [], "outside": [], "failed": {}, "skipped": {}}
for info in pkgutil.walk_packages(polytrain.__path__, "polytrain."):
    try:
        module = importlib.import_module(info.name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        # An optional framework that is not installed; a broken polytrain import is a failure.
        optional = type(exc).__name__ == "MissingDependencyError" or (
            isinstance(exc, ModuleNotFoundError) and not missing.startswith("polytrain"))
        report["skipped" if optional else "failed"][info.name] = f"{type(exc).__name__}: {exc}"
        continue
    except Exception as exc:
        report["failed"][info.name] = f"{type(exc).__name__}: {exc}"
        continue
    for cls in classes(module, ""):
        if issubclass(cls, BaseException):
            name = f"{cls.__module__}.{cls.__qualname__}"
            report["checked"].append(name)
            if not issubclass(cls, PolytrainError):
                report["outside"].append(f"{name} {[b.__name__ for b in cls.__mro__[1:]]}")
print("REPORT" + json.dumps(report))
"""


def test_every_polytrain_exception_derives_from_polytrain_error():
    # A fresh interpreter: importing every module (Lightning included) must not leak
    # into the other tests' process.
    proc = subprocess.run(
        [sys.executable, "-c", _EXCEPTION_SCAN],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.rsplit("REPORT", 1)[1])
    print("skipped (optional dependency missing):", report["skipped"])
    assert report["failed"] == {}
    assert "polytrain.errors.ConfigTypeError" in report["checked"]
    assert report["outside"] == []


def test_exception_named_classes_derive_from_polytrain_error_statically():
    """Also from the source: covers modules the scan above had to skip.

    A class whose name ends in Error or Exception must have PolytrainError among
    its ancestors, followed by base name through the classes of the package.
    """
    classes = {}  # class name -> base names, over the whole package
    for path in _package_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                classes[f"{_module_name(path)}.{node.name}"] = (node.name, bases)
    polytrain_errors = {"PolytrainError"}
    while True:  # grow the set of subclasses until it stops changing
        more = {name for name, bases in classes.values() if bases & polytrain_errors}
        if more <= polytrain_errors:
            break
        polytrain_errors |= more
    bad = [
        f"{qualified}({', '.join(sorted(bases))})"
        for qualified, (name, bases) in classes.items()
        if re.search(r"(Error|Exception)$", name) and name not in polytrain_errors
    ]
    assert bad == []


# -------------------------------------------------------------------- sizes
def _function_lengths(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node.end_lineno - node.lineno + 1
            yield from _function_lengths(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _function_lengths(node, f"{prefix}{node.name}.")
        else:
            yield from _function_lengths(node, prefix)


def test_no_module_is_over_800_lines():
    too_long = []
    for path in _package_modules().values():
        rel = path.relative_to(REPO_ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and rel not in SIZE_EXCEPTIONS:
            too_long.append(f"{rel}: {lines} lines")
    assert too_long == []


def test_no_function_is_over_60_lines():
    too_long = []
    for path in _package_modules().values():
        rel = path.relative_to(REPO_ROOT).as_posix()
        for name, lines in _function_lengths(ast.parse(path.read_text())):
            if lines > MAX_FUNCTION_LINES and f"{rel}::{name}" not in SIZE_EXCEPTIONS:
                too_long.append(f"{rel}::{name}: {lines} lines")
    assert too_long == []


def test_size_exceptions_are_still_needed():
    modules = {p.relative_to(REPO_ROOT).as_posix(): p for p in _package_modules().values()}
    for key in SIZE_EXCEPTIONS:
        rel, _, function = key.partition("::")
        assert rel in modules, f"{key}: no such module"
        text = modules[rel].read_text()
        if function:
            lengths = dict(_function_lengths(ast.parse(text)))
            assert lengths.get(function, 0) > MAX_FUNCTION_LINES, f"{key} fits now"
        else:
            assert len(text.splitlines()) > MAX_MODULE_LINES, f"{key} fits now"


# ------------------------------------------------------------ config errors
DDP = REPO_ROOT / "examples" / "configs" / "ddp.yaml"


@pytest.mark.parametrize(
    "values",
    [{"num_workers": -1}, {"num_workers": "2"}, {"use_gpu": "yes"}, {"num_cpus_per_worker": -1}],
)
def test_bad_scaling_config_field_is_a_config_error(values):
    from polytrain.trainer_api.options.configs import ScalingConfig

    with pytest.raises(ConfigError):
        ScalingConfig(**values)


def test_unknown_option_keys_are_config_errors():
    from polytrain.trainer_api.options.configs import ScalingConfig, coerce_config

    with pytest.raises(ConfigError, match="num_wokers"):
        coerce_config(ScalingConfig, {"num_wokers": 2}, "scaling_config")


def test_bad_backend_config_key_is_a_config_type_error():
    from polytrain.backends.registry import get_backend_class
    from polytrain.trainer_api.options.run_config import load_config

    config_cls = get_backend_class("ddp").config_cls
    with pytest.raises(ConfigTypeError, match="bogus"):
        config_cls.from_value({"bogus": 1}, "ddp")
    with pytest.raises(ConfigTypeError, match=r"backend_config: Unknown backend_config key"):
        load_config(DDP, ["backend_config.bogus=1"]).build_trainer()


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("epochs=0", ConfigError),
        ("scheduler_step_freq=daily", ConfigError),
        ("model=not a path", ConfigError),
        ("backend=nope", ConfigError),
        ("epochs=two", ConfigTypeError),
        ("scaling.num_wokers=2", ConfigTypeError),
        ("num_workers=-1", ConfigError),
    ],
)
def test_bad_run_config_value_is_a_config_error(override, error):
    from polytrain.trainer_api.options.run_config import load_config

    with pytest.raises(error):
        load_config(DDP, [override])


def test_bad_arguments_of_the_faces_are_config_errors(tmp_path):
    from polytrain.compare.runner import compare_backends
    from polytrain.trainer_api.options.run_config import parse_overrides
    from polytrain.trainer_api.trainable import tune_resources

    with pytest.raises(ConfigTypeError):
        compare_backends(42, ["ddp"], out_dir=tmp_path, log=None)
    with pytest.raises(ConfigError):
        parse_overrides(["no-equals-sign"])
    with pytest.raises(ConfigError):
        tune_resources(num_workers=0)
