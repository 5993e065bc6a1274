"""Tools that ship with polytrain but are not part of its API (``python -m polytrain.tools.X``).

- :mod:`polytrain.tools.gpu_check`: the offline GPU check (``scripts/gpu_check.sh``).

Nothing in the package imports them.
"""
