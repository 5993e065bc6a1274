"""With the warm pool on, a new group lands where it would with the pool off (issue 31, item 1).

On the simulated cluster of test_multinode.py (a head with 0 CPUs and two 2-CPU
worker nodes), tests/integration/pool_placement_script.py starts a group of 2
workers, shuts it down, then starts 2 with another placement strategy; once with
the pool off, once with it on (the first group then waits idle in the pool). The
second group must be placed the same: idle groups whose CPUs it could use yield
before its placement group is created. Which of two empty nodes PACK picks is
Ray's choice, so a layout is compared as the number of workers per node (sorted),
and SPREAD / STRICT_SPREAD must use both worker nodes.

Issue 39, item 2: four trainers in sequence with SPREAD (ddp, horovod, fairscale, fsdp)
each land on both worker nodes with a local world of 1; and a SPREAD group placed right
after two groups that filled both nodes were stopped (idle groups that yield to it, or
groups stopped outside the pool, as after a failure) waits until Ray has really given
their bundles back, so it spreads as well (before, it could pack both workers on the node
that freed first).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Every test starts with an empty warm pool: these tests compare placements with the pool on and off.
KEEP_WARM_POOL = False


SCRIPT = Path(__file__).with_name("pool_placement_script.py")
CASES = [
    "SPREAD after PACK",
    "SPREAD after STRICT_PACK",
    "PACK after SPREAD",
    "STRICT_SPREAD after PACK",
]


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool_placement") / "result.json"
    # Ray's socket paths live under RAY_TMPDIR and must stay below 108 bytes: a short dir.
    ray_tmp = tempfile.mkdtemp(prefix="ptpp", dir="/tmp")
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")
    }
    env["RAY_TMPDIR"] = ray_tmp
    env.pop("POLYTRAIN_WARM_POOL", None)
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.exists(), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def _layout(ips: list[str]) -> list[int]:
    return sorted(collections.Counter(ips).values())


@pytest.mark.parametrize("case", CASES)
def test_a_new_group_lands_as_with_the_pool_off(placements, case):
    result = placements["cases"][case]
    assert "error" not in result, result.get("error")
    off, on = result["off"], result["on"]
    assert on["idle_before_second"] == 2 and not on["second_reused"]  # the pool was in play
    assert _layout(on["first"]) == _layout(off["first"])
    assert _layout(on["second"]) == _layout(off["second"]), result
    if case.startswith(("SPREAD", "STRICT_SPREAD")):
        assert sorted(on["second"]) == sorted(off["second"]) == ["127.0.0.2", "127.0.0.3"]
    assert on["stopped"] >= 1  # the idle group yielded


def test_four_spread_trainers_in_sequence_each_use_both_nodes(placements):
    placed = placements["sequence"]
    assert "error" not in placed, placed.get("error") if isinstance(placed, dict) else placed
    assert [p["backend"] for p in placed] == ["ddp", "horovod", "fairscale", "fsdp"]
    for trainer in placed:
        workers = trainer["workers"]
        assert sorted(w["ip"] for w in workers) == ["127.0.0.2", "127.0.0.3"], trainer
        assert [w["context_local_world_size"] for w in workers] == [1, 1], trainer
        if trainer["backend"] != "horovod":  # Horovod's ranks come from its own rendezvous
            assert [w["local_world_size"] for w in workers] == ["1", "1"], trainer


def test_a_group_that_makes_idle_groups_yield_still_spreads(placements):
    runs = placements["race"]
    assert "error" not in runs, runs.get("error") if isinstance(runs, dict) else runs
    for run in runs:  # both worker nodes were full: of idle workers, or of stopped ones
        assert run["idle_before"] == (4 if run["case"] == "idle" else 0), run
        assert sorted(run["ips"]) == ["127.0.0.2", "127.0.0.3"], runs
