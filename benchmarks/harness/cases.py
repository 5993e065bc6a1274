"""What the benchmarks launch: :class:`Case` and the commands of the native and polytrain runs.

A case names the scripts it starts by their path under ``benchmarks/`` (``native/...``
for the hand-written scripts under their native launchers, ``drivers/...`` for the
polytrain and Ray Train driver scripts); :mod:`benchmarks.harness.runner` launches them.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.workloads.gpt2 import LMSpec
from benchmarks.workloads.mlp import NUM_WORKERS, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
BIN = Path(sys.executable).parent


#: A command line and the environment variables it adds to the runner's.
Command = tuple[list[str], dict[str, str]]


@dataclasses.dataclass
class Case:
    """One thing to launch: its commands (all started at once) and what it needs."""

    key: str
    label: str
    tag: str
    kind: str  # "native" | "polytrain" | "raytrain" | "scenario" (metrics from driver.json)
    commands: list[Command]
    spec: WorkloadSpec | LMSpec
    requires: tuple[str, ...] = ()
    timeout_s: float = 300.0
    baseline: str | None = None  # key of the case this one is compared with
    #: Builds ``commands`` anew at each launch instead (e.g. free ports picked then).
    commands_at_launch: Callable[[], list[Command]] | None = None


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def python_command(script: str, *args: str) -> list[str]:
    """``python benchmarks/<script> args...`` with this interpreter."""
    return [sys.executable, str(BENCH / script), *args]


def torchrun_command(script: str, *args: str) -> list[str]:
    """``torchrun`` on :data:`NUM_WORKERS` local ranks of ``benchmarks/<script> args...``."""
    return [str(BIN / "torchrun"), f"--nproc_per_node={NUM_WORKERS}", str(BENCH / script), *args]


# ------------------------------------------------------------------ cases
def native_command(tag: str, s: str) -> tuple[str, list[str], tuple[str, ...]]:
    """The label, command line and required modules of ``tag``'s native run on spec JSON ``s``."""
    deepspeed = "native/deepspeed_native.py"
    native = {
        "ddp": ("torchrun + DDP script", torchrun_command("native/ddp_native.py", "--spec", s), ()),
        "fairscale": (
            "torchrun + fairscale OSS/ShardedDDP script",
            torchrun_command("native/fairscale_native.py", "--spec", s),
            ("fairscale",),
        ),
        "deepspeed": (
            "torchrun + DeepSpeed ZeRO-2 engine script",
            torchrun_command(deepspeed, "--spec", s, "--stage", "2"),
            ("deepspeed",),
        ),
        "zero3": (
            "torchrun + DeepSpeed ZeRO-3 engine script",
            torchrun_command(deepspeed, "--spec", s, "--stage", "3"),
            ("deepspeed",),
        ),
        "fsdp": (
            "torchrun + FSDP script",
            torchrun_command("native/fsdp_native.py", "--spec", s),
            (),
        ),
        "horovod": (
            "horovodrun --gloo -np 2 + Horovod script",
            [str(BIN / "horovodrun"), "--gloo", "-np", str(NUM_WORKERS), sys.executable]
            + [str(BENCH / "native/horovod_native.py"), "--spec", s],
            ("horovod",),
        ),
    }
    return native[tag]


def torch_cases(
    tag: str, spec: WorkloadSpec | LMSpec, prefix: str, timeout_s: float | None = None
) -> list[Case]:
    """The native run and the polytrain run of one torch backend on ``spec``.

    ``tag`` is a backend name, or "zero3": DeepSpeed ZeRO-3 (the deepspeed backend with
    ``stage=3`` against the engine script with ``--stage 3``). ``spec`` is a
    :class:`WorkloadSpec` or a GPT-2 :class:`~benchmarks.workloads.gpt2.LMSpec`.
    """
    s = spec.to_json()
    timeout = timeout_s or (600.0 if spec.model == "big" else 300.0)
    backend_config = {
        "deepspeed": {"stage": 2},
        "zero3": {"stage": 3},
        "fairscale": {"mode": "sddp"},
    }.get(tag)
    backend = "deepspeed" if tag == "zero3" else tag
    label, argv, requires = native_command(tag, s)
    native_key = f"{prefix}/native-{tag}"
    driver = python_command(
        "drivers/polytrain_torch.py",
        *("--backend", backend, "--backend-config", json.dumps(backend_config), "--spec", s),
    )
    return [
        Case(native_key, label, tag, "native", [(argv, {})], spec, requires, timeout),
        Case(
            f"{prefix}/polytrain-{tag}",
            f'polytrain TorchTrainer(backend="{backend}"'
            + (f", backend_config={backend_config})" if tag == "zero3" else ")"),
            tag,
            "polytrain",
            [(driver, {})],
            spec,
            requires,
            timeout,
            baseline=native_key,
        ),
    ]
