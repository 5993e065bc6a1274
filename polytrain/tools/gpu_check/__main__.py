"""``python -m polytrain.tools.gpu_check COMMAND [options]`` (``COMMAND --help`` for each)."""

from __future__ import annotations

import importlib
import sys

#: Command -> the module whose ``main(argv)`` runs it.
COMMANDS = {
    "run": "polytrain.tools.gpu_check.run",
    "worker": "polytrain.tools.gpu_check.worker",
    "prepare": "polytrain.tools.gpu_check.bundle",
    "verify": "polytrain.tools.gpu_check.bundle",
    "split": "polytrain.tools.gpu_check.bundle",
    "join": "polytrain.tools.gpu_check.bundle",
    "results": "polytrain.tools.gpu_check.results",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command's module."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m polytrain.tools.gpu_check {{{','.join(COMMANDS)}}} [options]")
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    if module.__name__.endswith(".bundle"):
        return module.main(argv)  # its subcommands share the module
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
