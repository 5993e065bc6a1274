"""Hides modules from every Python process that has this folder on ``PYTHONPATH``.

The tests of the Ray-free worker path put this folder first on ``PYTHONPATH`` of a
subprocess (and so of everything ``torchrun`` starts from it): importing ``ray``
then fails as on a machine without Ray.

- ``POLYTRAIN_HIDDEN_MODULES``: the top-level modules to hide, comma-separated
  (default ``ray``), e.g. those the GPU check's target image lacks.
- ``POLYTRAIN_VISIBLE_IN``: a folder (an offline bundle installed with ``pip
  --target``): a hidden module found there is imported from there, so a test sees
  exactly what the bundle brings, not what this machine's environment has.
"""

import importlib.abc
import importlib.machinery
import os
import sys

HIDDEN = tuple(
    name.strip()
    for name in os.environ.get("POLYTRAIN_HIDDEN_MODULES", "ray").split(",")
    if name.strip()
)
VISIBLE_IN = os.environ.get("POLYTRAIN_VISIBLE_IN") or None


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        root = name.split(".")[0]
        if root not in HIDDEN:
            return None
        if VISIBLE_IN is not None:
            loaded = sys.modules.get(root)
            if name != root and loaded is not None:
                origin = getattr(loaded, "__file__", None) or ""
                if origin.startswith(VISIBLE_IN):
                    return None  # a submodule of the bundle's copy: import it normally
            if name == root:
                spec = importlib.machinery.PathFinder.find_spec(root, [VISIBLE_IN])
                if spec is not None:
                    return spec
        raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)


sys.meta_path.insert(0, _Hide())
