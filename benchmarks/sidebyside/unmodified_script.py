"""RESULTS.md section 11: ``polytrain launch`` against ``torchrun`` on one unmodified script.

Both runners start ``benchmarks/native/ddp_native.py`` (a torchrun script that
reads ``RANK``/``WORLD_SIZE``/``MASTER_*`` and calls ``init_process_group``)
unchanged on 2 ranks: ``torchrun --nproc_per_node=2 script`` and
``polytrain launch -n 2 script``, interleaved (A, B, A, B, ...); launch to first
step is measured from starting the command, so polytrain's number includes the
``ray.init`` of a fresh local Ray instance that the command starts.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.harness.cases import BENCH, Case, native_command
from benchmarks.harness.tables import meta_line, render_time_table
from benchmarks.workloads.mlp import NUM_WORKERS, WorkloadSpec

#: The section's name in the suite's ``--only`` and in ``benchmarks/out/<name>.json``.
SECTION = "launch"
TITLE = "### 11. Unmodified torchrun script: torchrun vs polytrain launch (MLP 784-512-512-10)"
NATIVE_KEY = "launch/native-ddp"
LAUNCH_KEY = "launch/polytrain-launch"


def groups(spec: WorkloadSpec) -> list[list[Case]]:
    """One interleaving group: torchrun and ``polytrain launch`` on the same script."""
    s = spec.to_json()
    label, argv, requires = native_command("ddp", s)
    script = str(BENCH / "native/ddp_native.py")
    launch = [sys.executable, "-m", "polytrain", "launch", "-n", str(NUM_WORKERS), script]
    return [
        [
            Case(NATIVE_KEY, label, "launch", "native", [(argv, {})], spec, requires),
            Case(
                LAUNCH_KEY,
                f"polytrain launch -n {NUM_WORKERS} (same script, fresh local Ray)",
                "launch",
                "native",
                [([*launch, "--spec", s], {})],
                spec,
                requires,
                baseline=NATIVE_KEY,
            ),
        ]
    ]


def render(all_results: dict[str, dict[str, Any]]) -> list[str]:
    """The section, if measured: the launch/step table of both runners (ratios against torchrun)."""
    section = all_results.get(SECTION)
    if not section:
        return []
    out = [TITLE, "", meta_line(section), ""]
    out += render_time_table(section, [NATIVE_KEY, LAUNCH_KEY])
    out += [
        "",
        "(Launch to first step counts from starting the command; polytrain launch's includes "
        "starting a local Ray instance, which a session on a running cluster "
        "(`--address`) does not pay.)",
        "",
    ]
    return out
