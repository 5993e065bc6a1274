"""Hides installed packages from every Python process that has this folder on ``PYTHONPATH``.

The tests of the Ray-free worker path put this folder first on ``PYTHONPATH`` of a
subprocess (and so of everything ``torchrun`` starts from it): importing ``ray``
then fails as on a machine without Ray, ``importlib.util.find_spec("ray")`` is None
and ``importlib.metadata.version("ray")`` raises ``PackageNotFoundError``, as they
would there (libraries probe packages these ways before importing them).

- ``POLYTRAIN_HIDDEN_MODULES``: the top-level modules to hide, comma-separated
  (default ``ray``), e.g. those the GPU check's target image lacks. Their
  distributions (dashes or underscores alike) are hidden too.
- ``POLYTRAIN_VISIBLE_IN``: a folder (an offline bundle installed with ``pip
  --target``): a hidden package found there is found, imported and versioned from
  there, so a test sees exactly what the bundle brings, not this machine's environment.
"""

import importlib.machinery
import importlib.metadata
import os
import re

HIDDEN = frozenset(
    name.strip()
    for name in os.environ.get("POLYTRAIN_HIDDEN_MODULES", "ray").split(",")
    if name.strip()
)
VISIBLE_IN = os.environ.get("POLYTRAIN_VISIBLE_IN") or None

_find_spec = importlib.machinery.PathFinder.find_spec.__func__
_from_name = importlib.metadata.Distribution.from_name.__func__


def _hidden_find_spec(cls, fullname, path=None, target=None):
    # Top-level lookups only (path None): a submodule is found inside its parent's folder.
    if path is None and fullname in HIDDEN:
        if VISIBLE_IN is None:
            return None
        return _find_spec(cls, fullname, [VISIBLE_IN], target)
    return _find_spec(cls, fullname, path, target)


def _hidden_from_name(cls, name):
    if re.sub(r"[-_.]+", "_", name).lower() in HIDDEN:
        found = list(
            importlib.metadata.distributions(name=name, path=[VISIBLE_IN] if VISIBLE_IN else [])
        )
        if not found:
            raise importlib.metadata.PackageNotFoundError(name)
        return found[0]
    return _from_name(cls, name)


importlib.machinery.PathFinder.find_spec = classmethod(_hidden_find_spec)
importlib.metadata.Distribution.from_name = classmethod(_hidden_from_name)
