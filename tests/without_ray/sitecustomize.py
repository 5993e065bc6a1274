"""Hides modules from every Python process that has this folder on ``PYTHONPATH``.

The tests of the Ray-free worker path put this folder first on ``PYTHONPATH`` of a
subprocess (and so of everything ``torchrun`` starts from it): importing ``ray``
then fails as on a machine without Ray. ``POLYTRAIN_HIDDEN_MODULES`` names the
top-level modules to hide, comma-separated (default ``ray``), e.g.
``ray,deepspeed,fairscale,omegaconf`` for the GPU check's target node.
"""

import importlib.abc
import os
import sys

HIDDEN = tuple(
    name.strip()
    for name in os.environ.get("POLYTRAIN_HIDDEN_MODULES", "ray").split(",")
    if name.strip()
)


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


sys.meta_path.insert(0, _Hide())
