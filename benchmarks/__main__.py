"""``python -m benchmarks SUITE [options]``: the same entry point as ``benchmarks/run.py``."""

import sys

from benchmarks.run import main

sys.exit(main())
