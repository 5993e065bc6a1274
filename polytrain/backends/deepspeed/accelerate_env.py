"""The ``deepspeed`` backend as Accelerate's DeepSpeed plugin: the environment of ``accelerate launch``.

Accelerate builds its ``DeepSpeedPlugin`` from ``ACCELERATE_DEEPSPEED_CONFIG_FILE``
when an ``Accelerator()`` (or the HF ``Trainer``) is created without one; that
variable takes a path or a base64-encoded JSON config, and polytrain passes the
backend's resolved config inline (so every node reads the same one). The mapping:

=============================  =================================================
DeepSpeedConfig                DeepSpeed config seen by Accelerate
=============================  =================================================
stage, offload_optimizer,      ``zero_optimization`` (stage, ``offload_*`` devices)
offload_param
config                         merged over the typed fields, as for polytrain's own loop
gradient_accumulation_steps    the config's value when set (typed or in ``config``),
                               else ``"auto"``: the HF Trainer fills it from its
                               ``TrainingArguments``
=============================  =================================================

Batch sizes and ``gradient_clipping`` stay ``"auto"`` unless ``config`` sets them:
the HF Trainer fills them from its ``TrainingArguments`` (Accelerate from the
prepared data loader), as with any DeepSpeed config written for Accelerate.
``dist_backend`` needs no variable (the process group exists before the loop), and
``init_on_rank0`` is ZeRO-3's ``zero.Init``, which Accelerate turns on for stage 3
by itself (``zero3_init_flag``).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from polytrain.backends.deepspeed.config import DeepSpeedConfig
from polytrain.errors import ConfigError

#: Why Accelerate cannot run DeepSpeed on CPU workers.
CPU_REFUSAL = (
    "Accelerate runs DeepSpeed only on accelerators: on a CPU worker it finds no device "
    "backend, counts one process and hangs or trains each worker alone, and with use_cpu it "
    "drops DeepSpeed for plain DDP. Use use_gpu=True, or backend='ddp' on CPU "
    "(polytrain's own deepspeed loop helpers, polytrain.train.torch.prepare, run ZeRO on CPU)."
)

_AUTO = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")


def deepspeed_accelerate_config(config: DeepSpeedConfig) -> dict[str, Any]:
    """The DeepSpeed config Accelerate gets: the backend's, with ``"auto"`` where it says nothing."""
    resolved = config.resolved()
    typed_default = config.gradient_accumulation_steps == 1
    if typed_default and "gradient_accumulation_steps" not in config._user_config:
        resolved["gradient_accumulation_steps"] = "auto"
    for key in _AUTO:
        resolved.setdefault(key, "auto")
    return resolved


def deepspeed_accelerate_env(config: DeepSpeedConfig, use_gpu: bool) -> dict[str, str]:
    """``ACCELERATE_USE_DEEPSPEED`` and the config inline (base64 JSON) for Accelerate.

    Raises:
        ConfigError: on CPU workers.
    """
    if not use_gpu:
        raise ConfigError(f"The deepspeed backend cannot run under Accelerate here: {CPU_REFUSAL}")
    encoded = json.dumps(deepspeed_accelerate_config(config)).encode()
    return {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": base64.urlsafe_b64encode(encoded).decode(),
    }
