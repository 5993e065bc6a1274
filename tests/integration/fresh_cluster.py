"""Run a script that builds its own simulated Ray cluster, in a fresh process, and read its JSON.

A driver joins one Ray cluster per process, so tests of a simulated multi-node cluster
(``ray.cluster_utils.Cluster``) cannot share the test session's Ray instance: their script
runs in a fresh process, with a private ``RAY_TMPDIR`` (Cluster writes its address into
``<tmp>/ray/ray_current_cluster``; the shared ``/tmp/ray`` must not be touched) and without
the session's ``RAY_ADDRESS``, and writes its findings to a JSON file the tests read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run_script_on_fresh_cluster(
    script: Path | str, out: Path, *args: str, timeout_s: float = 900, prefix: str = "ptmn"
) -> dict:
    """``python script OUT.json args...`` in a fresh process; the JSON it wrote.

    Raises:
        AssertionError: the script wrote no JSON (its exit code and output tails are shown).
    """
    # Ray's socket paths live under RAY_TMPDIR and must stay below 108 bytes: a short dir.
    ray_tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")
    }
    env["RAY_TMPDIR"] = ray_tmp
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(out), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.exists(), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())
