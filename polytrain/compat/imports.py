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

from polytrain.errors import MissingDependencyError

__all__ = [
    "MissingDependencyError",
    "Requirement",
    "install_hint",
    "module_available",
    "register_install_hint",
    "require",
]

# module -> how to install it. The backends' modules are registered by their registry
# entries (polytrain.backends.registry), the one source of facts about a backend;
# these are the features that are not backends.
_HINTS: dict[str, str] = {
    "pytorch_lightning": 'pip install "polytrain[lightning]"',
    "torchmetrics": 'pip install "polytrain[lightning]"',
    "ray.tune": 'pip install "polytrain[tune]"',
    "safetensors": 'pip install "polytrain[hf]"',
    "transformers": 'pip install "polytrain[hf]"',
    "huggingface_hub": 'pip install "polytrain[hf]"',
    "accelerate": 'pip install "polytrain[hf]"',
    "trl": 'pip install "polytrain[trl]"',
}


def register_install_hint(module: str, hint: str) -> None:
    """Record how ``module`` is installed (its root package gets the same hint)."""
    _HINTS[module] = hint
    _HINTS.setdefault(module.split(".")[0], hint)


def install_hint(module: str) -> str:
    """Return the command that installs ``module`` for polytrain."""
    root = module.split(".")[0]
    return _HINTS.get(module) or _HINTS.get(root) or f"pip install {root}"


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
