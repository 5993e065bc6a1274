"""release_free_memory gives glibc's retained free heap back to the OS (the set-up's churn)."""

from __future__ import annotations

import gc
import os

import pytest

from polytrain.compat import allocator


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(allocator._libc() is None, reason="needs glibc's malloc_trim (Linux)")
def test_freed_heap_memory_leaves_the_process():
    # 300 MiB in 64 KiB chunks: under the mmap threshold, so freeing them leaves the
    # pages in glibc's heap (resident) until trimmed. The last chunk stays alive so the
    # heap top cannot shrink by itself.
    chunks = [bytearray(64 * 1024) for _ in range(4800)]
    keep = bytearray(64 * 1024)
    del chunks
    gc.collect()
    before = _rss_mib()
    assert allocator.release_free_memory() is True
    after = _rss_mib()
    assert before - after > 150, (before, after)
    del keep


def test_no_libc_means_nothing_to_release(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert allocator.release_free_memory() is False


def _churn_rise_mib() -> float:
    """RSS left after 200 freed 2 MiB blocks, each followed by a small block kept alive."""
    gc.collect()
    before = _rss_mib()
    blocks, keepers = [], []
    for _ in range(200):
        blocks.append(bytearray(2 << 20))
        keepers.append(bytearray(4096))  # from malloc (not pymalloc): pins the heap top
    del blocks
    gc.collect()
    rise = _rss_mib() - before
    del keepers
    allocator.release_free_memory()
    return rise


@pytest.mark.skipif(allocator._libc() is None, reason="needs glibc's mallopt (Linux)")
def test_blocks_freed_under_large_blocks_mapped_leave_at_once():
    # A freed 16 MiB mapping raises glibc's dynamic threshold to 16 MiB, as a set-up's
    # first large frees do: 2 MiB blocks would then live in the heap and stay resident.
    large = bytearray(16 << 20)
    del large
    with allocator.large_blocks_mapped():
        assert _churn_rise_mib() < 50
