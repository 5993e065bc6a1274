"""What the benchmarks launch: :class:`Case` and the commands of the native and polytrain runs."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path

from benchmarks.lm_workload import LMSpec
from benchmarks.workload import NUM_WORKERS, WorkloadSpec

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
BIN = Path(sys.executable).parent


@dataclasses.dataclass
class Case:
    """One thing to launch: its commands (all started at once) and what it needs."""

    key: str
    label: str
    tag: str
    kind: str  # "native" | "polytrain" | "raytrain" | "scenario" (metrics from driver.json)
    commands: list[tuple[list[str], dict[str, str]]]
    spec: WorkloadSpec | LMSpec
    requires: tuple[str, ...] = ()
    timeout_s: float = 300.0
    baseline: str | None = None  # key of the case this one is compared with


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def _torchrun(script: str, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), f"--nproc_per_node={NUM_WORKERS}", str(BENCH / script), *args]


# ------------------------------------------------------------------ cases
def native_command(tag: str, s: str) -> tuple[str, list[str], tuple[str, ...]]:
    """The label, command line and required modules of ``tag``'s native run on spec JSON ``s``."""
    deepspeed = "native/deepspeed_native.py"
    native = {
        "ddp": ("torchrun + DDP script", _torchrun("native/ddp_native.py", "--spec", s), ()),
        "fairscale": (
            "torchrun + fairscale OSS/ShardedDDP script",
            _torchrun("native/fairscale_native.py", "--spec", s),
            ("fairscale",),
        ),
        "deepspeed": (
            "torchrun + DeepSpeed ZeRO-2 engine script",
            _torchrun(deepspeed, "--spec", s, "--stage", "2"),
            ("deepspeed",),
        ),
        "zero3": (
            "torchrun + DeepSpeed ZeRO-3 engine script",
            _torchrun(deepspeed, "--spec", s, "--stage", "3"),
            ("deepspeed",),
        ),
        "fsdp": ("torchrun + FSDP script", _torchrun("native/fsdp_native.py", "--spec", s), ()),
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
    :class:`WorkloadSpec` or a GPT-2 :class:`~benchmarks.lm_workload.LMSpec`.
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
    driver = _py(
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


#: polytrain's Lightning strategies in the lightning benchmark: (``--strategy`` of
#: drivers/polytrain_lightning.py, label, modules the variant needs).
LIGHTNING_VARIANTS = (
    ("ddp", "polytrain RayStrategy(num_workers=2) (ddp)", ()),
    ("horovod", "polytrain RayHorovodStrategy(num_workers=2)", ("horovod",)),
    ("sharded", "polytrain RayShardedStrategy(num_workers=2) (fairscale)", ("fairscale",)),
    ("deepspeed", "polytrain RayDeepSpeedStrategy(num_workers=2) (ZeRO-2)", ("deepspeed",)),
)


def lightning_cases(spec: WorkloadSpec, prefix: str = "lightning") -> list[Case]:
    """Lightning's ``strategy="ddp"`` under torchrun, then polytrain's strategies, on one module.

    Every case trains :class:`benchmarks.native.lightning_native.WorkloadModule` with
    the same Trainer options; each polytrain case is compared with the torchrun run.
    A DeepSpeed launch may compile DeepSpeed's communication extension first (once per
    machine), hence its longer timeout.
    """
    s = spec.to_json()
    native_key = f"{prefix}/native-ddp"
    cases = [
        Case(
            native_key,
            'torchrun + Lightning Trainer(strategy="ddp")',
            "lightning",
            "native",
            [(_torchrun("native/lightning_native.py", "--spec", s), {})],
            spec,
            ("pytorch_lightning",),
        )
    ]
    for variant, label, requires in LIGHTNING_VARIANTS:
        argv = _py("drivers/polytrain_lightning.py", "--strategy", variant, "--spec", s)
        cases.append(
            Case(
                f"{prefix}/polytrain-{variant}",
                label,
                "lightning",
                "polytrain",
                [(argv, {})],
                spec,
                ("pytorch_lightning", *requires),
                600.0 if variant == "deepspeed" else 300.0,
                baseline=native_key,
            )
        )
    return cases
