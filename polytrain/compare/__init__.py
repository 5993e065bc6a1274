"""One model on several backends: ``compare_backends`` and its table, CSV and plot.

- :mod:`~polytrain.compare.runner`: running the backends one after another;
- :mod:`~polytrain.compare.report`: the table, CSV and plot;
- :mod:`~polytrain.compare.divergence`: flagging backends that drift from the first.
"""

from polytrain.compare.runner import (
    CSV_COLUMNS,
    DEFAULT_TOLERANCE,
    FAILED,
    OK,
    SKIPPED,
    BackendResult,
    compare_backends,
    default_run_dir,
    flag_divergence,
    format_table,
    write_results,
)

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_TOLERANCE",
    "FAILED",
    "OK",
    "SKIPPED",
    "BackendResult",
    "compare_backends",
    "default_run_dir",
    "flag_divergence",
    "format_table",
    "write_results",
]
