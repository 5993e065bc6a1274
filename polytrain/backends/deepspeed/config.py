"""Options of the ``deepspeed`` backend: typed fields plus a DeepSpeed JSON config, and the config each worker passes to ``deepspeed.initialize``."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.backends.core.backend import BackendConfig
from polytrain.backends.core.step_options import StepOptions
from polytrain.errors import ConfigError

__all__ = ["DeepSpeedConfig"]

_STAGES = (0, 1, 2, 3)
# Sections polytrain fills in itself: the optimizer and scheduler come from the
# creators, the batch sizes from config["batch_size"] and the world size.
_OWNED_SECTIONS = ("optimizer", "scheduler")


@dataclass
class DeepSpeedConfig(BackendConfig):
    """Options of the ``deepspeed`` backend.

    The typed fields cover the common settings; ``config`` takes any DeepSpeed
    JSON config (a dict or a path to a ``.json`` file) for everything else.

    Precedence: the DeepSpeed ``config`` is merged over the typed fields, section
    by section (nested dicts are merged key by key), so an existing
    ``ds_config.json`` is honoured as written. A typed field set to a non-default
    value that disagrees with the same setting in ``config`` is an error, never a
    silent override. polytrain always sets the batch sizes (from the trainer's
    ``config["batch_size"]``, the world size and ``gradient_accumulation_steps``)
    and passes the optimizer built by ``optimizer_creator``; ``config`` may repeat
    matching batch sizes but must not contain ``optimizer`` or ``scheduler``.
    Mixed precision follows the trainer's ``use_fp16`` (fp16 on GPU, bf16 autocast
    on CPU) unless ``config`` has its own ``fp16``, ``bf16`` or ``torch_autocast``
    section.

    Attributes:
        stage: ZeRO stage, 0-3. The default 2 shards optimizer state and gradients
            with no extra communication in the forward pass (DeepSpeed's and
            Lightning's usual choice); 3 also shards the parameters, for models that
            do not fit on one device, at the price of gathering them every forward.
        config: a DeepSpeed JSON config as a dict or a path to a JSON file.
        offload_optimizer: keep optimizer state and its step on the CPU (ZeRO-Offload;
            stages 1-3, needs ``use_gpu=True``).
        offload_param: keep the parameters on the CPU between uses (stage 3 only,
            needs ``use_gpu=True``).
        gradient_accumulation_steps: micro-batches per optimizer step; DeepSpeed
            reduces and steps only at the accumulation boundary.
        dist_backend: "gloo", "nccl", or None for nccl on GPU and gloo on CPU.
        init_on_rank0: ZeRO-3 only: build the model inside ``deepspeed.zero.Init`` on
            every rank (one module at a time, partitioned as it is built: no rank holds
            the full parameters) and give it the weights ``model_creator`` builds for real
            on rank 0, so they equal those of a build outside ``zero.Init``. None
            (default): on for stage 3; False: every rank builds the full model.

    Raises:
        ConfigError: a value that is not allowed, or a DeepSpeed config that
            disagrees with the typed fields or has a section polytrain owns.
    """

    stage: int = 2
    config: dict[str, Any] | str | os.PathLike | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    gradient_accumulation_steps: int = 1
    dist_backend: str | None = None
    init_on_rank0: bool | None = None

    def __post_init__(self) -> None:
        self._check_fields()
        self._user_config = _load_user_config(self.config)
        for section in _OWNED_SECTIONS:
            if section in self._user_config:
                creator = f"{section}_creator"
                raise ConfigError(
                    f"The DeepSpeed config has an '{section}' section "
                    f"({self._user_config[section]!r}); polytrain builds the {section} with the "
                    f"trainer's {creator}, which DeepSpeed then wraps. Remove '{section}' from "
                    f"the DeepSpeed config and return the {section} from {creator} instead."
                )
        self._check_conflicts()
        self._check_zero_section()
        self._check_init_on_rank0()

    def _check_init_on_rank0(self) -> None:
        value = self.init_on_rank0
        if value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"init_on_rank0 must be True, False or None (the default: on for ZeRO stage "
                f"3); got {value!r}."
            )
        if value and self.zero_stage != 3:
            raise ConfigError(
                f"init_on_rank0=True needs ZeRO stage 3 (parameters partitioned); stage "
                f"{self.zero_stage} keeps the full parameters on every rank. Use stage=3 or drop "
                f"init_on_rank0."
            )

    def builds_on_rank0(self) -> bool:
        """Whether the model is built under ``deepspeed.zero.Init`` with rank 0's weights."""
        return self.zero_stage == 3 and self.init_on_rank0 is not False

    def _check_fields(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in _STAGES:
            raise ConfigError(
                f"DeepSpeed ZeRO stage {self.stage!r} is not supported. Must be one of "
                f"{list(_STAGES)} (0: plain data parallel, 1: optimizer state sharded, "
                f"2: + gradients, 3: + parameters)."
            )
        steps = self.gradient_accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"gradient_accumulation_steps must be a positive int; got {steps!r}.")
        if self.dist_backend not in ("gloo", "nccl", None):
            raise ConfigError(
                f"The provided dist_backend ({self.dist_backend!r}) is not supported. Must be "
                f"either 'gloo', 'nccl' or None (nccl on GPU, gloo on CPU)."
            )

    def _check_zero_section(self) -> None:
        zero = self.resolved().get("zero_optimization", {})
        stage = zero.get("stage", self.stage)
        if stage not in _STAGES:
            raise ConfigError(
                f"DeepSpeed config zero_optimization.stage={stage!r} is not supported. Must be "
                f"one of {list(_STAGES)}."
            )
        if _offload_device(zero, "offload_param") and stage != 3:
            raise ConfigError(
                f"offload_param needs ZeRO stage 3; got stage {stage}. Use stage=3 or "
                f"offload_optimizer, which works with stages 1-3."
            )
        if _offload_device(zero, "offload_optimizer") and stage == 0:
            raise ConfigError(
                "offload_optimizer needs ZeRO stage 1, 2 or 3; got stage 0. Pick a stage >= 1."
            )

    def _typed_sections(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.offload_param:
            zero["offload_param"] = {"device": "cpu"}
        return {
            "zero_optimization": zero,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def _check_conflicts(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        user = self._user_config
        user_zero = user.get("zero_optimization") or {}
        checks = [
            ("stage", self.stage, user_zero.get("stage"), "zero_optimization.stage"),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
                user.get("gradient_accumulation_steps"),
                "gradient_accumulation_steps",
            ),
        ]
        for name, typed, given, where in checks:
            if given is not None and typed != defaults[name] and typed != given:
                raise ConfigError(
                    f"{name}={typed!r} disagrees with the DeepSpeed config's {where}={given!r}. "
                    f"Set it in one place only."
                )
        for name in ("offload_optimizer", "offload_param"):
            typed = getattr(self, name)
            if typed and name in user_zero and not _offload_device(user_zero, name):
                raise ConfigError(
                    f"{name}=True disagrees with the DeepSpeed config's "
                    f"zero_optimization.{name}={user_zero[name]!r}. Set it in one place only."
                )

    def resolved(self) -> dict[str, Any]:
        """The DeepSpeed config from the typed fields and ``config`` (without batch sizes)."""
        return _deep_merge(self._typed_sections(), self._user_config)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect (``config`` may set it)."""
        return int(self.resolved()["zero_optimization"].get("stage", self.stage))

    def offloads(self) -> list[str]:
        """The ZeRO offloads in effect (``"offload_optimizer"``, ``"offload_param"``)."""
        zero = self.resolved().get("zero_optimization", {})
        return [
            name for name in ("offload_optimizer", "offload_param") if _offload_device(zero, name)
        ]

    def worker_config(
        self,
        micro_batch: int | None,
        world_size: int,
        *,
        use_fp16: bool,
        device_type: str,
        step: StepOptions | None = None,
    ) -> dict[str, Any]:
        """The DeepSpeed config a worker initialises its engine with.

        Args:
            micro_batch: the worker's batch size (its training loader's); None before the
                loader exists (for ``zero.Init``, which reads no batch size): a placeholder
                of 1, the config's own batch sizes left out.
            world_size: the number of workers.
            use_fp16: the trainer's ``use_fp16`` (fp16 on GPU, bf16 autocast on CPU),
                unless ``config`` sets its own precision section.
            device_type: ``"cuda"`` or ``"cpu"``.
            step: the trainer's step options: its accumulation, clipping and precision
                become the engine's ``gradient_accumulation_steps``, ``gradient_clipping``
                and ``bf16`` / ``fp16`` sections.

        Raises:
            ConfigError: ``config`` sets batch sizes other than the trainer runs, or
                accumulation / clipping other than the trainer's.
        """
        ds_config = copy.deepcopy(self.resolved())
        if micro_batch is None:
            micro_batch = 1
            for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
                ds_config.pop(key, None)
        step = step or StepOptions()
        apply_step_options(ds_config, step)
        steps = int(ds_config.get("gradient_accumulation_steps", 1))
        expected = {
            "train_micro_batch_size_per_gpu": int(micro_batch),
            "train_batch_size": int(micro_batch) * steps * world_size,
        }
        for key, value in expected.items():
            if key in ds_config and ds_config[key] != value:
                raise ConfigError(
                    f"The DeepSpeed config sets {key}={ds_config[key]!r}, but the trainer runs "
                    f"{value} (per-worker batch {micro_batch} from config['batch_size'], "
                    f"{steps} accumulation step(s), {world_size} worker(s)). Drop {key} "
                    f"from the DeepSpeed config and set the global batch with config['batch_size']."
                )
        ds_config.update(expected)
        _set_worker_defaults(
            ds_config, use_fp16=use_fp16, device_type=device_type, bf16=step.precision == "bf16"
        )
        return ds_config


def apply_step_options(ds_config: dict[str, Any], step: StepOptions) -> None:
    """The trainer's accumulation and clipping as the engine's config keys."""
    if step.accumulates:
        _set_once(ds_config, "gradient_accumulation_steps", step.gradient_accumulation_steps)
    if step.max_grad_norm is not None:
        _set_once(ds_config, "gradient_clipping", float(step.max_grad_norm))


def _set_once(ds_config: dict[str, Any], key: str, value: Any) -> None:
    """Set the trainer's ``value`` unless the DeepSpeed config already says otherwise."""
    given = ds_config.get(key)
    default = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0}[key]
    if given is not None and given != default and given != value:
        raise ConfigError(
            f"The trainer's {key.replace('gradient_clipping', 'max_grad_norm')}={value!r} "
            f"disagrees with the DeepSpeed config's {key}={given!r}. Set it in one place only "
            f"(the trainer keyword works on every backend)."
        )
    ds_config[key] = value


def _set_worker_defaults(
    ds_config: dict[str, Any], *, use_fp16: bool, device_type: str, bf16: bool = False
) -> None:
    """Fill in what polytrain decides unless the DeepSpeed config says otherwise."""
    ds_config.setdefault("steps_per_print", 2**31 - 1)
    # DeepSpeed >= 0.19 clips gradients to norm 1.0 unless told otherwise; every other
    # backend applies the user's optimizer as built, so clipping is opt-in here too.
    ds_config.setdefault("gradient_clipping", 0.0)
    # Any torch optimizer the user built is accepted; element-wise ones (SGD, Adam,
    # AdamW, RMSprop...) give the same updates on flat partitions as on tensors.
    ds_config.setdefault("zero_allow_untested_optimizer", True)
    if _offload_device(ds_config.get("zero_optimization", {}), "offload_optimizer"):
        # The user's torch optimizer steps the offloaded partitions on the CPU.
        ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
    if use_fp16 and not any(k in ds_config for k in ("fp16", "bf16", "torch_autocast")):
        if device_type == "cuda" and bf16:
            ds_config["bf16"] = {"enabled": True}  # bf16 weights, fp32 master copies
        elif device_type == "cuda":
            ds_config["fp16"] = {"enabled": True, "auto_cast": True}
        else:
            # fp32 master weights, bf16 forward under DeepSpeed's own autocast.
            ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}


# --------------------------------------------------------------------- helpers
def _load_user_config(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)):
        return _load_config_file(Path(value))
    raise ConfigError(
        f"DeepSpeed config must be a dict, a path to a JSON file or None; got "
        f"{type(value).__name__}: {value!r}."
    )


def _load_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"DeepSpeed config file {str(path)!r} does not exist. Pass a path to a JSON file "
            f"or a dict."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config file {str(path)!r} is not valid JSON: {exc}."
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"DeepSpeed config file {str(path)!r} must hold a JSON object; got "
            f"{type(loaded).__name__}."
        )
    return loaded


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _offload_device(zero: dict[str, Any], name: str) -> bool:
    section = zero.get(name)
    if not isinstance(section, dict):
        return bool(section)
    return str(section.get("device", "none")).lower() not in ("none", "")
