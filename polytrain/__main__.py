"""``python -m polytrain``: the same as the ``polytrain`` command."""

import sys

from polytrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
