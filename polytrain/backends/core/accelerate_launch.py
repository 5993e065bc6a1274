"""``accelerate launch``'s environment for ``polytrain launch --accelerate-config FILE``.

An Accelerate script (``Accelerator()``, an HF ``Trainer``, TRL) launched with an
Accelerate config file gets, on every rank, what ``accelerate launch --config_file
FILE`` would give it: torchrun's rank variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` of rank 0, ``TORCHELASTIC_*``) and
the ``ACCELERATE_*`` / ``FSDP_*`` variables Accelerate's own launcher computes
from the file (``accelerate.utils.launch``: the same functions ``accelerate
launch`` calls). The config's ``distributed_type`` names the backend
(``FSDP``: fsdp, ``DEEPSPEED``: deepspeed, ``MULTI_GPU`` / ``MULTI_CPU`` / ``NO``:
ddp); a ``--backend`` that says otherwise, or a config whose devices contradict
``--gpus-per-worker``, is refused. polytrain's ``-n`` is the number of processes
(``accelerate launch --num_processes``); Ray places them and gives each its GPU.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from polytrain.backends.core.launch_env import LaunchAttempt, TorchrunEnv
from polytrain.compat.imports import require
from polytrain.errors import ConfigError

if TYPE_CHECKING:
    from polytrain.launchers.base import WorkerGroup

logger = logging.getLogger(__name__)

#: Accelerate's distributed types and the polytrain backend each one is.
BACKEND_OF = {
    "FSDP": "fsdp",
    "DEEPSPEED": "deepspeed",
    "MULTI_GPU": "ddp",
    "MULTI_CPU": "ddp",
    "NO": "ddp",
}

#: Variables of ``accelerate launch`` that polytrain sets per rank itself (rank 0's
#: address, the GPU Ray gives each worker, threads per CPU) or that point at the
#: driver's working directory.
_OWN = ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_SHARDED = ("FSDP", "DEEPSPEED")


def config_backend(config_file: str, backend: str | None, use_gpu: bool) -> tuple[str, str]:
    """The Accelerate config's distributed type and the backend it is, checked against ``backend``.

    Args:
        config_file: an ``accelerate config`` YAML or JSON file.
        backend: the canonical backend name asked for (None: take the config's).
        use_gpu: whether the ranks get GPUs.

    Raises:
        ConfigError: no such file, a distributed type polytrain has no backend for, a
            backend that contradicts it, or devices that contradict ``use_gpu``.
    """
    require("accelerate", "polytrain launch --accelerate-config")
    from accelerate.commands.config.config_args import load_config_from_file

    if not os.path.isfile(config_file):
        raise ConfigError(
            f"polytrain launch --accelerate-config {config_file!r}: no such file. Write one with "
            f"`accelerate config --config_file {config_file}` or pass the path of yours."
        )
    config = load_config_from_file(config_file)
    kind = getattr(config.distributed_type, "name", str(config.distributed_type))
    wanted = BACKEND_OF.get(kind)
    if wanted is None:
        raise ConfigError(
            f"The Accelerate config {config_file} has distributed_type: {kind}, which polytrain "
            f"cannot launch; it launches {', '.join(sorted(BACKEND_OF))} (backends fsdp, "
            f"deepspeed and ddp)."
        )
    if backend is not None and backend != wanted:
        raise ConfigError(
            f"The Accelerate config {config_file} has distributed_type: {kind}, which is the "
            f"{wanted} backend, but --backend {backend} was given. They contradict: pass "
            f"--backend {wanted} (or leave --backend out), or use a config for {backend}."
        )
    config_cpu = bool(getattr(config, "use_cpu", False)) or kind == "MULTI_CPU"
    if use_gpu and config_cpu:
        raise ConfigError(
            f"The Accelerate config {config_file} trains on CPUs (distributed_type: {kind}, "
            f"use_cpu: {getattr(config, 'use_cpu', False)}) but --gpus-per-worker gives the ranks "
            f"GPUs. Drop --gpus-per-worker, or use a config without use_cpu."
        )
    if not use_gpu and (kind in _SHARDED or kind == "MULTI_GPU"):
        raise ConfigError(
            f"The Accelerate config {config_file} has distributed_type: {kind}, which needs GPUs: "
            f"Accelerate runs FSDP and DeepSpeed only on accelerators (on a CPU it finds no device "
            f"backend and trains every rank alone). Pass --gpus-per-worker 1, or on CPUs use a "
            f"config with distributed_type: MULTI_CPU (use_cpu: true)."
        )
    return kind, wanted


def accelerate_launch_env(
    config_file: str, kind: str, num_workers: int, use_gpu: bool
) -> dict[str, str]:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch`` computes from the file.

    Accelerate's launcher functions are called as ``accelerate launch`` calls them;
    what they return beyond the driver's own environment is kept, except the
    variables polytrain sets per rank (:data:`_OWN`). A DeepSpeed config file is
    passed inline (base64 JSON, which Accelerate reads too), so every node has it.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as accelerate_launch

    argv = ["--config_file", config_file, "--num_processes", str(num_workers), "script.py"]
    args, defaults, precision_from_file = _validate_launch_command(
        launch_command_parser().parse_args(argv)
    )
    if kind == "DEEPSPEED":
        # What `accelerate launch` tells its DeepSpeed launcher: the fields the file set.
        fields = list(defaults.deepspeed_config) + (
            ["mixed_precision"] if precision_from_file else []
        )
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = accelerate_launch.prepare_deepspeed_cmd_env(args)
    elif kind in ("FSDP", "MULTI_GPU"):
        env = accelerate_launch.prepare_multi_gpu_env(args)
    else:
        _, env = accelerate_launch.prepare_simple_launcher_cmd_env(args)
    extra = {
        key: value
        for key, value in env.items()
        if os.environ.get(key) != value and key not in _OWN and not key.startswith("KMP_")
    }
    if not use_gpu:
        # More than one CPU rank: Accelerate's MULTI_CPU mode (on the ranks' gloo group).
        extra["ACCELERATE_USE_CPU"] = "true"
    path = extra.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and os.path.isfile(path):
        extra["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = base64.urlsafe_b64encode(
            Path(path).read_bytes()
        ).decode()
    return extra


class AccelerateLaunchEnv(TorchrunEnv):
    """``accelerate launch --config_file FILE``: torchrun's variables plus Accelerate's.

    Args:
        config_file: the Accelerate config file.
        backend: the canonical backend asked for (None: the config's).
        use_gpu: whether the ranks get GPUs.
        num_workers: the number of ranks (``--num_processes``).
        local_rank_arg: unused (Accelerate's launchers pass no ``--local_rank``).

    Raises:
        ConfigError: see :func:`config_backend`.
    """

    launcher = "accelerate launch"

    def __init__(
        self,
        config_file: str,
        backend: str | None,
        use_gpu: bool,
        num_workers: int,
        local_rank_arg: bool = True,
    ) -> None:
        super().__init__(local_rank_arg=False)
        self.kind, self.backend = config_backend(config_file, backend, use_gpu)
        self.extra = accelerate_launch_env(config_file, self.kind, num_workers, use_gpu)

    def envs(self, group: WorkerGroup, attempt: LaunchAttempt) -> list[dict[str, str]]:
        """Driver: torchrun's variables for every rank, with Accelerate's on top."""
        return [{**env, **self.extra} for env in super().envs(group, attempt)]
