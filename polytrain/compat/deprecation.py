"""Renamed public names: the old one keeps working for a while and says what replaced it."""

from __future__ import annotations

import warnings


def renamed(old: str, new: str, why: str = "") -> None:
    """Warn (DeprecationWarning, at the caller's caller) that ``old`` is now ``new``."""
    warnings.warn(
        f"{old} is now {new}{f' ({why})' if why else ''}; {old} will be removed.",
        DeprecationWarning,
        stacklevel=3,
    )


#: Why "preemption" names became "drain" names (one word per thing, see docs/failures.md).
DRAIN_WORD = "a drain is Ray's announced loss of a node"
