"""Optional-dependency checks with install hints.

Nothing here imports an optional framework: availability is answered from the
installed distributions' metadata (``importlib.util.find_spec``), so asking
whether TensorFlow is installed costs microseconds, not seconds.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType

# module -> the polytrain extra that installs it
_EXTRA_FOR_MODULE = {
    "horovod": "horovod",
    "horovod.torch": "horovod",
    "fairscale": "fairscale",
    "deepspeed": "deepspeed",
    "tensorflow": "tensorflow",
    "tf_keras": "tensorflow",
    "pytorch_lightning": "lightning",
    "torchmetrics": "lightning",
    "ray.tune": "tune",
}

_SPECIAL_HINTS = {
    "horovod": (
        "horovod 0.28.1 must be built against the installed torch: run "
        "`bash scripts/install_horovod.sh` (it wraps the compiler for C++17 and builds with gloo)"
    ),
}


def install_hint(module: str) -> str:
    """Return the command that installs ``module`` for polytrain."""
    root = module.split(".")[0]
    extra = _EXTRA_FOR_MODULE.get(module) or _EXTRA_FOR_MODULE.get(root)
    if root in _SPECIAL_HINTS:
        return _SPECIAL_HINTS[root]
    if extra:
        return f'pip install "polytrain[{extra}]"'
    return f"pip install {root}"


@functools.cache
def module_available(module: str) -> bool:
    """True when ``module`` can be found on the path, without importing it or its parents.

    ``importlib.util.find_spec("a.b")`` would import ``a`` (horovod's package
    import alone costs a second); the path finder walks the packages instead.
    """
    root, *rest = module.split(".")
    if root in sys.modules:
        return importlib.util.find_spec(module) is not None if rest else True
    try:
        spec = importlib.machinery.PathFinder.find_spec(root)
        for part in rest:
            if spec is None or not spec.submodule_search_locations:
                return False
            spec = importlib.machinery.PathFinder.find_spec(part, spec.submodule_search_locations)
        return spec is not None
    except (ImportError, ValueError):
        return False


class MissingDependencyError(ImportError):
    """An optional framework that a requested feature needs is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise a :class:`MissingDependencyError` naming the fix.

    Args:
        module: dotted module name, e.g. ``"deepspeed"``.
        feature: what needs it, for the message (e.g. ``'backend "deepspeed"'``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{feature} needs the Python package '{module}', which is not importable "
            f"({type(exc).__name__}: {exc}). Install it with: {install_hint(module)}"
        ) from exc


@dataclass(frozen=True)
class Requirement:
    """A lazily evaluated availability flag, like Lightning's ``RequirementCache``."""

    module: str

    def __bool__(self) -> bool:
        return module_available(self.module)

    def __str__(self) -> str:
        if self:
            return f"{self.module} is available"
        return f"{self.module} is not installed: {install_hint(self.module)}"


HOROVOD_AVAILABLE = Requirement("horovod.torch")
FAIRSCALE_AVAILABLE = Requirement("fairscale")
DEEPSPEED_AVAILABLE = Requirement("deepspeed")
TENSORFLOW_AVAILABLE = Requirement("tensorflow")
TF_KERAS_AVAILABLE = Requirement("tf_keras")
LIGHTNING_AVAILABLE = Requirement("pytorch_lightning")


def _main() -> None:  # pragma: no cover - a convenience printout for scripts/setup.sh
    for flag in (
        HOROVOD_AVAILABLE,
        FAIRSCALE_AVAILABLE,
        DEEPSPEED_AVAILABLE,
        TENSORFLOW_AVAILABLE,
        TF_KERAS_AVAILABLE,
        LIGHTNING_AVAILABLE,
    ):
        print(f"  {'yes' if flag else 'no ':4} {flag}")


if __name__ == "__main__":  # pragma: no cover
    _main()
