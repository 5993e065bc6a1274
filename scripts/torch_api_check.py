"""Does polytrain call anything an older torch lacks? A static check against that torch's source.

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform macosx_11_0_arm64 torch==2.11.0 -d /tmp/torch-old
    unzip -q /tmp/torch-old/torch-*.whl 'torch/*' -d /tmp/torch-old/src
    python scripts/torch_api_check.py /tmp/torch-old/src/torch

Reads the older torch's Python source (the macOS wheel is the small one: ~80 MB, where
the Linux wheels carry CUDA) and this environment's torch, and reports:

1. every ``from torch... import name`` in polytrain, scripts and tests that the older
   torch does not define;
2. every function, method or dataclass field of the torch modules polytrain uses
   whose parameters the installed torch has and the older one lacks, with polytrain's
   calls that pass such a parameter by keyword (those need a guard, as
   ``polytrain.backends.core.ddp_signature`` guards DDP's renamed argument).

Exit status 1 when (1) finds anything or (2) finds a use in polytrain.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("polytrain", "scripts", "tests", "examples")
#: The torch modules polytrain calls into (source files under torch/).
MODULES = (
    "distributed/distributed_c10d.py",
    "distributed/device_mesh.py",
    "distributed/fsdp/_fully_shard/_fully_shard.py",
    "distributed/fsdp/_fully_shard/_fsdp_api.py",
    "distributed/fsdp/fully_sharded_data_parallel.py",
    "distributed/fsdp/api.py",
    "distributed/fsdp/wrap.py",
    "distributed/fsdp/sharded_grad_scaler.py",
    "distributed/checkpoint/state_dict.py",
    "distributed/tensor/_api.py",
    "distributed/tensor/_utils.py",
    "nn/parallel/distributed.py",
    "nn/modules/module.py",
    "nn/utils/clip_grad.py",
    "utils/checkpoint.py",
    "amp/grad_scaler.py",
    "cuda/__init__.py",
    "cuda/memory.py",
    "__init__.py",
)


def _module_file(src: Path, module: str) -> Path | None:
    base = src.parent / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi")):
        if candidate.exists():
            return candidate
    return None


def _defines(src: Path, path: Path, name: str, depth: int = 0) -> bool:
    """Whether the module file defines or imports ``name`` (following ``from .x import *``)."""
    text = path.read_text(errors="ignore")
    patterns = (rf"^\s*(async )?def {name}\b", rf"^\s*class {name}\b", rf"^{name}\s*[:=]",
                rf"\bimport .*\b{name}\b", rf"^\s+{name},?\s*$", rf"\bas {name}\b")  # fmt: skip
    if any(re.search(p, text, re.M) for p in patterns):
        return True
    if depth > 2:
        return False
    for star in re.finditer(r"^from (\.*)([\w.]*) import \*", text, re.M):
        dots, module = star.groups()
        if dots:
            base = path.parent
            for _ in range(len(dots) - 1):
                base = base.parent
            target = base / module.replace(".", "/")
            candidates = [target.with_suffix(".py"), target / "__init__.py"]
        else:
            candidates = [_module_file(src, module) or path]
        for candidate in candidates:
            if (
                candidate != path
                and candidate.exists()
                and _defines(src, candidate, name, depth + 1)
            ):
                return True
    return False


def missing_imports(old: Path) -> list[str]:
    """``from torch.x import y`` statements whose module or name the older torch lacks."""
    missing = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                    continue
                if node.module.split(".")[0] != "torch":
                    continue
                module = _module_file(old, node.module)
                for alias in node.names:
                    sub = _module_file(old, f"{node.module}.{alias.name}")
                    if module is None or (sub is None and not _defines(old, module, alias.name)):
                        where = path.relative_to(ROOT)
                        missing.append(f"{where}:{node.lineno}: {node.module}.{alias.name}")
    return missing


def _signatures(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
                out.setdefault(prefix + child.name, set()).update(names)
            elif isinstance(child, ast.ClassDef):
                fields = {
                    t.target.id
                    for t in child.body
                    if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
                }
                if fields:
                    out[prefix + child.name + ".<fields>"] = fields
                visit(child, prefix + child.name + ".")

    visit(ast.parse(path.read_text()), "")
    return out


def newer_parameters(old: Path) -> list[tuple[str, str, str]]:
    """(module, function, parameter) that the installed torch has and the older one lacks."""
    new = Path(torch.__file__).parent
    found = []
    for module in MODULES:
        if not (old / module).exists() or not (new / module).exists():
            continue
        before, after = _signatures(old / module), _signatures(new / module)
        for name, params in after.items():
            if name.split(".")[-1].startswith("_") and not name.endswith("__init__"):
                continue
            for param in sorted(params - before.get(name, params)):
                found.append((module, name, param))
    return found


def _callee(function: str) -> str:
    """The name a call uses: ``f`` for ``f`` and ``C.f``, ``C`` for ``C.__init__`` and fields."""
    parts = function.split(".")
    return parts[-2] if parts[-1] in ("__init__", "<fields>") and len(parts) > 1 else parts[-1]


def uses(function: str, parameter: str) -> list[str]:
    """polytrain's calls of ``function`` (by its last name) that pass ``parameter`` by keyword."""
    callee, hits = _callee(function), []
    for path in sorted((ROOT / "polytrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == callee and any(k.arg == parameter for k in node.keywords):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def main(argv: list[str]) -> int:
    """Print both reports; 1 when polytrain needs a guard."""
    if len(argv) != 1:
        print(__doc__)
        return 2
    old = Path(argv[0])
    version = re.search(r"__version__ = '([^']+)'", (old / "version.py").read_text())
    print(
        f"installed torch {torch.__version__}; older torch {version.group(1) if version else '?'}"
    )
    missing = missing_imports(old)
    print(f"\nimports the older torch lacks: {len(missing)}")
    print("\n".join(f"  {m}" for m in missing))
    guarded = 0
    print("\nparameters the older torch lacks, and polytrain's lines naming them:")
    for module, name, param in newer_parameters(old):
        hits = uses(name, param)
        guarded += bool(hits)
        print(f"  {module}: {name}({param})" + "".join(f"\n      {h}" for h in hits))
    return 1 if missing or guarded else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
