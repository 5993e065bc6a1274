"""What worker processes start with: one glibc malloc arena, as a torchrun rank has in effect.

A Ray actor runs its tasks on a thread of Ray's, never on the process's main
thread. glibc gives a thread that allocates an arena of its own (up to 8 per
core); such an arena is a chain of mmap'd heaps of at most 64 MiB, and glibc
unmaps a heap as soon as it is wholly free (``heap_trim`` in glibc's arena.c), so
the next step maps and faults those pages in again. A torchrun rank trains on its
main thread, in the main (brk) arena, which keeps its free top up to
``M_TRIM_THRESHOLD``. On a 355M model with 4 CPU ranks
(``benchmarks/parallel``, 2026-11-28) polytrain's ranks took 10-20 % more page
faults per step than torchrun's and their steps took 4.6-6.6 % longer; with
``MALLOC_ARENA_MAX=1`` the faults are at torchrun's level and the step time 0.98-1.03
of it (median window ratios, ``benchmarks/RESULTS.md``).

glibc reads ``MALLOC_ARENA_MAX`` once, when the process starts: setting it in a
running worker changes nothing. So it travels in the actors' Ray ``runtime_env``
(Ray starts the process with it), not with the environment a worker sets on
itself (:class:`~polytrain.launchers.worker.Worker`).

The user's value wins: one in the Ray job's ``runtime_env`` is left to Ray, and
one in the driver's environment travels to the workers on every node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: glibc's variable: the most malloc arenas a process creates.
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
#: One arena: every thread allocates in the main (brk) arena, as a torchrun rank's
#: training (main) thread does.
SINGLE_ARENA = "1"


def single_arena_env() -> dict[str, str]:
    """What a torch backend asks its worker processes to start with: one malloc arena."""
    return {ARENA_MAX_ENV: SINGLE_ARENA}


def resolve_process_env(
    requested: Mapping[str, str], job_env_vars: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment the worker processes start with: ``requested``, with the user's values.

    A variable the Ray job's ``runtime_env`` sets (``job_env_vars``) is dropped:
    Ray gives the workers the job's value. One the driver's environment sets
    replaces the requested value, so the user's choice reaches the workers on
    every node of a cluster (a local Ray instance would inherit it anyway).
    """
    job_env_vars = job_env_vars or {}
    return {
        key: os.environ.get(key, value)
        for key, value in requested.items()
        if key not in job_env_vars
    }
