"""release_free_memory gives glibc's retained free heap back to the OS (the set-up's churn)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from polytrain.compat import allocator

REPO_ROOT = Path(__file__).resolve().parents[2]

# Each measurement runs in a fresh interpreter: the resident size is the whole process's,
# and a pytest process that ran other tests before holds free heap chunks that glibc
# serves the measured blocks from (before any mmap threshold applies), and threads
# (Ray's driver) that allocate beside them.
_PRELUDE = """
import gc, json, os
from polytrain.compat import allocator

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
"""


def _measure(body: str) -> Any:
    """Run ``body`` after the prelude in a fresh Python; its last line printed, as JSON."""
    code = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(allocator._libc() is None, reason="needs glibc's malloc_trim (Linux)")
def test_freed_heap_memory_leaves_the_process():
    # 300 MiB in 64 KiB chunks: under the mmap threshold, so freeing them leaves the
    # pages in glibc's heap (resident) until trimmed. The last chunk stays alive so the
    # heap top cannot shrink by itself.
    result = _measure(
        """
        chunks = [bytearray(64 * 1024) for _ in range(4800)]
        keep = bytearray(64 * 1024)
        del chunks
        gc.collect()
        before = rss_mib()
        released = allocator.release_free_memory()
        print(json.dumps({"released": released, "before": before, "after": rss_mib()}))
        """
    )
    assert result["released"] is True
    assert result["before"] - result["after"] > 150, result


def test_no_libc_means_nothing_to_release(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert allocator.release_free_memory() is False


#: RSS left after 200 freed 2 MiB blocks, each followed by a small block kept alive
#: (from malloc, not pymalloc: it pins the heap top). A freed 16 MiB mapping first raises
#: glibc's dynamic threshold to 16 MiB, as a set-up's first large frees do: 2 MiB blocks
#: would then live in the heap and stay resident.
_CHURN = """
large = bytearray(16 << 20)
del large

def churn_rise_mib():
    gc.collect()
    before = rss_mib()
    blocks, keepers = [], []
    for _ in range(200):
        blocks.append(bytearray(2 << 20))
        keepers.append(bytearray(4096))
    del blocks
    gc.collect()
    rise = rss_mib() - before
    del keepers
    allocator.release_free_memory()
    return rise
"""


def _churn_rise_in_a_fresh_process(mapped: bool) -> float:
    # A process of its own per case: a heap that already holds free chunks serves the
    # blocks from them before any threshold is consulted.
    churn = "rise = churn_rise_mib()\n"
    if mapped:
        churn = "with allocator.large_blocks_mapped():\n    " + churn
    return _measure(_CHURN + churn + "print(rise)")


@pytest.mark.skipif(allocator._libc() is None, reason="needs glibc's mallopt (Linux)")
def test_without_the_setting_the_churns_freed_blocks_stay_resident():
    assert _churn_rise_in_a_fresh_process(mapped=False) > 200


@pytest.mark.skipif(allocator._libc() is None, reason="needs glibc's mallopt (Linux)")
def test_blocks_freed_under_large_blocks_mapped_leave_at_once():
    assert _churn_rise_in_a_fresh_process(mapped=True) < 50
