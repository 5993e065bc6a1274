"""Giving the C allocator's free memory back to the operating system.

A large model's set-up frees as much as it keeps: ZeRO-3's ``zero.Init`` builds each
module in full and then partitions it, FSDP materialises and then shards, rank 0 builds
a full copy it only broadcasts. glibc keeps most of what was freed in its heap (chunks
under the mmap threshold, which grows to 32 MiB after large frees) for later
allocations, so the worker's resident memory stays near the set-up's peak: on GPT-2
medium under ZeRO-3 about 1 GiB per rank, seen by the kernel's OOM killer and by every
process beside it. ``malloc_trim(0)`` returns the free pages of every arena; it costs a
few milliseconds and changes no live tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Iterator
from typing import Any


@functools.lru_cache(maxsize=1)
def _libc() -> Any | None:
    """glibc, or None where there is none (macOS, musl): trimming is then skipped."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl has no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return libc


def release_free_memory() -> bool:
    """Return the allocator's free heap memory to the operating system (glibc only).

    Returns:
        True when glibc released memory, False when it had none to release or the
        platform's C library has no ``malloc_trim``.
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


#: glibc's mallopt parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
#: Blocks from this size on get their own mapping, given back the moment they are freed.
LARGE_BLOCK_BYTES = 1 << 20


@contextlib.contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Within: blocks of 1 MiB and more are mapped on their own (glibc only).

    A build that allocates each module in full and frees it once partitioned (ZeRO-3's
    ``zero.Init``) otherwise leaves the freed blocks in the heap, under glibc's mmap
    threshold, which grows to 32 MiB after the first large free: the resident memory
    climbs with every module although what is kept is only the partitions. Setting the
    threshold fixes it (and stops its growth). Afterwards the threshold is glibc's
    ceiling for the dynamic one, 32 MiB, where a training process's threshold ends up
    anyway after its first large frees (a lower fixed one would map and unmap every
    activation of each step).
    """
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        release_free_memory()
