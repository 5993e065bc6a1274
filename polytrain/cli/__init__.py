"""The ``polytrain`` command (``polytrain.cli:main``); the parser lives in :mod:`.main`."""

from polytrain.cli.main import main

__all__ = ["main"]
