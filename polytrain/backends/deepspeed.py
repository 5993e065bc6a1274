"""DeepSpeed ZeRO stages 0-3 on the workers' ``torch.distributed`` process group.

The trainer builds the model, the optimizer (``optimizer_creator``) and the
scheduler on every worker as usual; :meth:`DeepSpeedBackend.prepare` hands the
model and the user's optimizer to ``deepspeed.initialize``, which partitions the
optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3)
across the workers. On CPU DeepSpeed's accelerator falls back to gloo.

Checkpoints stay backend-independent: :meth:`~DeepSpeedBackend.full_state_dict`
returns the consolidated fp32 weights keyed like the user's module and the
optimizer state in plain ``torch.optim`` format, so a checkpoint written here
loads under ``ddp`` at any world size and the other way round.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polytrain.backends.base import Backend, BackendConfig, Components, WorkerContext
from polytrain.backends.torch_distributed import (
    default_dist_backend,
    start_process_group,
    stop_process_group,
)
from polytrain.errors import ConfigError
from polytrain.launchers.worker import find_free_port

logger = logging.getLogger(__name__)

_STAGES = (0, 1, 2, 3)
# Sections polytrain fills in itself: the optimizer and scheduler come from the
# creators, the batch sizes from config["batch_size"] and the world size.
_OWNED_SECTIONS = ("optimizer", "scheduler")
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")
# Environment DeepSpeed reads in a local-mode (driver) worker; restored on shutdown.
_LOCAL_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


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
    """

    stage: int = 2
    config: dict[str, Any] | str | os.PathLike | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    gradient_accumulation_steps: int = 1
    dist_backend: str | None = None

    def __post_init__(self) -> None:
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


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO data parallelism (stages 0-3); gloo on CPU, nccl on GPU.

    One model and one optimizer per trainer: DeepSpeed's engine wraps exactly one
    of each. The trainer keeps stepping the user's scheduler (per batch, per epoch
    or manually, as ``scheduler_step_freq`` says): it changes the learning rate in
    the param groups that the DeepSpeed optimizer steps. With
    ``gradient_accumulation_steps > 1`` every training batch is one micro-batch
    and a "batch" scheduler step happens per micro-batch.
    """

    name = "deepspeed"
    framework = "torch"
    config_cls = DeepSpeedConfig
    config: DeepSpeedConfig

    def __init__(self, config: DeepSpeedConfig | dict | None = None) -> None:
        super().__init__(config)
        self._local_env: dict[str, str | None] | None = None
        self._local_group = False

    # ----------------------------------------------------------------- driver
    def validate_settings(self, *, num_workers: int, use_gpu: bool, use_fp16: bool) -> None:
        """Driver: offload and nccl need GPUs; the DeepSpeed config must parse."""
        zero = self.config.resolved().get("zero_optimization", {})
        offloads = [
            name for name in ("offload_optimizer", "offload_param") if _offload_device(zero, name)
        ]
        if offloads and not use_gpu:
            raise ConfigError(
                f"DeepSpeed {' and '.join(offloads)} moves state from the GPU to the CPU and "
                f"needs use_gpu=True; got use_gpu=False. On CPU everything already lives in "
                f"host memory: drop {', '.join(offloads)} (ZeRO stages 1-3 still shard the "
                f"state across workers)."
            )
        if self.config.dist_backend == "nccl" and not use_gpu:
            raise ConfigError("dist_backend='nccl' needs use_gpu=True; use 'gloo' on CPU.")
        with _preserved_env():
            _validate_with_deepspeed(self.config.resolved())

    def on_start(self, group: Any, ctx_template: WorkerContext) -> None:
        """Driver: one process group over all workers (world size 1 in local mode)."""
        if not ctx_template.local_mode:
            start_process_group(group, ctx_template, self.config.dist_backend)
            return
        # Local mode: the driver is the worker. DeepSpeed needs a process group and the
        # torchrun variables; both are undone in on_shutdown.
        self._local_env = {key: os.environ.get(key) for key in _LOCAL_ENV_KEYS}
        if dist.is_initialized():
            self._local_group = False  # the caller's own group: use it, leave it alone
            os.environ.setdefault("LOCAL_RANK", "0")
            return
        port = find_free_port()
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
            }
        )
        import datetime

        dist.init_process_group(
            backend=self.config.dist_backend or default_dist_backend(ctx_template.use_gpu),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=ctx_template.timeout_s),
        )
        self._local_group = True

    def on_shutdown(self, group: Any) -> None:
        """Driver: destroy the process groups (dead workers are fine); restore local env."""
        if self._local_env is None:
            stop_process_group(group)
            return
        try:
            _forget_deepspeed_groups()
            if self._local_group and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            for key, value in self._local_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._local_env = None
            self._local_group = False

    # ----------------------------------------------------------------- worker
    def prepare(self, components: Components, ctx: WorkerContext) -> Components:
        """Worker: wrap the model and the user's optimizer in a DeepSpeed engine."""
        if len(components.models) != 1 or len(components.optimizers) != 1:
            raise ValueError(
                f"The deepspeed backend trains one model with one optimizer; the creators "
                f"returned {len(components.models)} model(s) and {len(components.optimizers)} "
                f"optimizer(s). Combine them into one nn.Module and one optimizer (param groups "
                f"allow per-part settings), or use backend='ddp' for several."
            )
        # Local mode runs in the driver: keep its environment as it was.
        with _preserved_env() if ctx.local_mode else contextlib.nullcontext():
            return self._initialize(components, ctx)

    def _initialize(self, components: Components, ctx: WorkerContext) -> Components:
        deepspeed = _import_deepspeed()
        _skip_unused_shm_extension()
        model = components.models[0]
        optimizer = components.optimizers[0]
        ds_config = self._worker_ds_config(components, ctx)
        args = None
        if ctx.device.type == "cuda":
            # Ray's GPU index, not LOCAL_RANK, names this worker's device.
            args = _DeviceArgs(device_rank=ctx.device.index or 0)
        # Param order of the user's optimizer, before ZeRO swaps in flat partitions:
        # the index space of the torch-format optimizer state in checkpoints.
        ordered = [[p for p in group["params"]] for group in optimizer.param_groups]
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=args,
            model=model,
            optimizer=optimizer,
            config=ds_config,
            dist_init_required=False,
        )
        components.models = [engine]
        components.optimizers = [ds_optimizer]
        components.scaler = None
        components.extra["deepspeed"] = _EngineState(engine, optimizer, ordered)
        return components

    def _worker_ds_config(self, components: Components, ctx: WorkerContext) -> dict[str, Any]:
        ds_config = copy.deepcopy(self.config.resolved())
        micro = getattr(components.train_loader, "batch_size", None) or 1
        steps = int(ds_config.get("gradient_accumulation_steps", 1))
        expected = {
            "train_micro_batch_size_per_gpu": int(micro),
            "train_batch_size": int(micro) * steps * ctx.world_size,
        }
        for key, value in expected.items():
            if key in ds_config and ds_config[key] != value:
                raise ValueError(
                    f"The DeepSpeed config sets {key}={ds_config[key]!r}, but the trainer runs "
                    f"{value} (per-worker batch {micro} from config['batch_size'], "
                    f"{steps} accumulation step(s), {ctx.world_size} worker(s)). Drop {key} "
                    f"from the DeepSpeed config and set the global batch with config['batch_size']."
                )
        ds_config.update(expected)
        ds_config.setdefault("steps_per_print", 2**31 - 1)
        # DeepSpeed >= 0.19 clips gradients to norm 1.0 unless told otherwise; every other
        # backend applies the user's optimizer as built, so clipping is opt-in here too.
        ds_config.setdefault("gradient_clipping", 0.0)
        # Any torch optimizer the user built is accepted; element-wise ones (SGD, Adam,
        # AdamW, RMSprop...) give the same updates on flat partitions as on tensors.
        ds_config.setdefault("zero_allow_untested_optimizer", True)
        zero = ds_config.get("zero_optimization", {})
        if _offload_device(zero, "offload_optimizer"):
            # The user's torch optimizer steps the offloaded partitions on the CPU.
            ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
        if ctx.use_fp16 and not any(k in ds_config for k in ("fp16", "bf16", "torch_autocast")):
            if ctx.device.type == "cuda":
                ds_config["fp16"] = {"enabled": True, "auto_cast": True}
            else:
                # fp32 master weights, bf16 forward under DeepSpeed's own autocast.
                ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        return ds_config

    def zero_grad(self, components: Components) -> None:
        """Worker: nothing to do; the engine clears gradients after each optimizer step.

        Clearing them before every backward would discard the micro-batches that
        DeepSpeed accumulates towards ``gradient_accumulation_steps``.
        """

    def backward(self, loss: torch.Tensor, components: Components) -> None:
        """Worker: ``engine.backward`` (loss scaling, accumulation, ZeRO reduction)."""
        _engine(components).backward(loss)

    def step(self, components: Components, optimizer_index: int | None = None) -> None:
        """Worker: ``engine.step``; it applies the update at accumulation boundaries only."""
        if optimizer_index not in (None, 0):
            raise ValueError(
                f"The deepspeed backend has one optimizer (index 0); got "
                f"optimizer_index={optimizer_index!r}."
            )
        _engine(components).step()

    def no_sync(self, components: Components) -> contextlib.AbstractContextManager:
        """Worker: a no-op; accumulate with ``gradient_accumulation_steps`` instead.

        DeepSpeed decides when gradients are reduced from its accumulation setting.
        """
        return contextlib.nullcontext()

    def autocast(self, ctx: WorkerContext) -> contextlib.AbstractContextManager:
        """Worker: a no-op; precision is set in the DeepSpeed config (see prepare)."""
        return contextlib.nullcontext()

    def make_scaler(self, ctx: WorkerContext) -> Any:
        """Worker: ``None``; DeepSpeed scales fp16 losses itself."""
        return None

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Worker: the user's module inside the DeepSpeed engine."""
        return getattr(model, "module", model)

    def full_state_dict(self, components: Components, ctx: WorkerContext) -> dict[str, Any] | None:
        """Worker (all ranks, collective): consolidated fp32 weights and torch-format optimizer state.

        Weights: every entry of the user's module ``state_dict``, unsharded, fp32 for
        floating-point tensors. Optimizer: the user's optimizer's state in plain
        ``torch.optim`` format (per-parameter tensors such as Adam's ``exp_avg`` and
        ``exp_avg_sq`` or SGD's ``momentum_buffer``, gathered from the ZeRO
        partitions, plus scalars such as ``step``); ``None`` where DeepSpeed wraps
        the optimizer in a way with no faithful torch form (fp16/bf16 master weights
        at stage 0), which loads as a fresh optimizer.
        """
        state = _engine_state(components)
        models = [_full_model_state(state, ctx)]
        optimizers = [_full_optimizer_state(state)]
        if ctx.world_rank != 0:
            return None
        return {"models": models, "optimizers": optimizers}

    def load_full_state_dict(
        self, components: Components, state: dict[str, Any], ctx: WorkerContext
    ) -> None:
        """Worker (all ranks): load consolidated weights and torch-format optimizer state.

        Works for a checkpoint from any backend and world size; training continues
        from the loaded weights (and optimizer state, when the checkpoint has it).
        """
        engine_state = _engine_state(components)
        (model_state,) = state["models"]
        _load_model_state(engine_state, model_state)
        optimizer_states = state.get("optimizers") or [None]
        _load_optimizer_state(engine_state, optimizer_states[0])


# --------------------------------------------------------------------- helpers
@dataclass
class _DeviceArgs:
    """The ``args`` DeepSpeed reads its device from."""

    device_rank: int


@dataclass
class _EngineState:
    """What the backend keeps per worker: the engine, the user's optimizer, its param order."""

    engine: Any
    user_optimizer: torch.optim.Optimizer
    param_groups: list[list[torch.nn.Parameter]]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group]

    @property
    def stage(self) -> int:
        return int(self.engine.zero_optimization_stage())


def _engine_state(components: Components) -> _EngineState:
    try:
        return components.extra["deepspeed"]
    except KeyError:
        raise RuntimeError(
            "The deepspeed backend has not prepared these components (prepare was not run)."
        ) from None


def _engine(components: Components) -> Any:
    return _engine_state(components).engine


def _load_user_config(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
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
    raise ConfigError(
        f"DeepSpeed config must be a dict, a path to a JSON file or None; got "
        f"{type(value).__name__}: {value!r}."
    )


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


def _validate_with_deepspeed(ds_config: dict[str, Any]) -> None:
    """Parse the config with DeepSpeed's own validators (nested keys, types, removed keys)."""
    from deepspeed.runtime.config import DeepSpeedConfig as _DSConfig

    probe = copy.deepcopy(ds_config)
    steps = int(probe.get("gradient_accumulation_steps", 1))
    # Batch sizes are filled in on the workers; any consistent values parse here.
    probe.setdefault("train_micro_batch_size_per_gpu", 1)
    probe.setdefault("train_batch_size", probe["train_micro_batch_size_per_gpu"] * steps)
    try:
        _DSConfig(probe)
    except Exception as exc:  # DeepSpeed raises pydantic, assertion and value errors
        raise ConfigError(
            f"DeepSpeed rejected the config {ds_config!r}: {type(exc).__name__}: {exc}. Fix the "
            f"named key (see https://www.deepspeed.ai/docs/config-json/)."
        ) from None


@contextlib.contextmanager
def _preserved_env() -> Any:
    """Undo the environment changes DeepSpeed and torch make for themselves on import/init.

    ``import deepspeed`` sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` and its engine's first
    use imports torch's inductor, which sets ``TORCHINDUCTOR_CACHE_DIR``; the driver
    (and a local-mode worker, which is the driver) keeps its environment.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _import_deepspeed() -> Any:
    """Import DeepSpeed without leaving its import-time environment changes behind."""
    with _preserved_env():
        import deepspeed
    return deepspeed


def _skip_unused_shm_extension() -> None:
    """Do not build DeepSpeed's shared-memory all-reduce extension on CPU.

    DeepSpeed compiles it on the first launch on a machine (40-120 s), but uses it
    only for inference all-reduce and only when LOCAL_SIZE is set; training never
    calls it. Gloo does the training collectives either way.
    """
    if "LOCAL_SIZE" in os.environ:
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:  # noqa: BLE001 - a DeepSpeed without the op table just builds it
        logger.debug("could not mark deepspeed_shm_comm as unused", exc_info=True)


def _forget_deepspeed_groups() -> None:
    """Drop DeepSpeed's cached process groups before the default group is destroyed.

    DeepSpeed caches sub-groups in module globals; a later trainer in the same
    process (local mode) would otherwise reuse groups of a destroyed world.
    """
    try:
        from deepspeed.utils import groups
    except Exception:  # noqa: BLE001 - nothing cached without DeepSpeed
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, name, None if not isinstance(value, dict) else {})


def _zero_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if hasattr(p, "ds_id")]


def _full_model_state(state: _EngineState, ctx: WorkerContext) -> dict[str, torch.Tensor] | None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = state.engine.module
    params = list(module.parameters())
    # Stage 3: every rank takes part in gathering the partitioned parameters.
    with deepspeed.zero.GatheredParameters(_zero_params(params), modifier_rank=None):
        local = {
            key: value.detach().to("cpu", copy=True) if ctx.world_rank == 0 else None
            for key, value in module.state_dict().items()
        }
    low_precision = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    if low_precision and state.stage > 0:
        # fp16/bf16 module weights: read the fp32 master copies instead (collective).
        for name, param in module.named_parameters(remove_duplicate=False):
            full = safe_get_full_fp32_param(param)
            if full is not None and ctx.world_rank == 0:
                local[name] = full.detach().reshape(_param_shape(param)).to("cpu", torch.float32)
    if ctx.world_rank != 0:
        return None
    return {
        key: value.float() if value is not None and value.is_floating_point() else value
        for key, value in local.items()
    }


def _flat_partitions(ds_optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 flat partitions, the tensors ZeRO's inner optimizer keeps state for.

    Stage 3 empties the inner optimizer's param groups between steps, so they are
    read from the ZeRO optimizer itself.
    """
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        flats = getattr(ds_optimizer, name, None)
        if flats:
            return list(flats)
    return [p for group in ds_optimizer.optimizer.param_groups for p in group["params"]]


def _flat_state_keys(ds_optimizer: Any) -> tuple[list[str], dict[str, Any]]:
    """Per-tensor state keys and scalar entries of ZeRO's inner optimizer (same on every rank)."""
    inner = ds_optimizer.optimizer
    for flat in _flat_partitions(ds_optimizer):
        entry = inner.state.get(flat)
        if entry:
            tensors = sorted(
                k
                for k, v in entry.items()
                if torch.is_tensor(v) and v.shape == flat.shape and v.dim() > 0
            )
            scalars = {k: v for k, v in entry.items() if k not in tensors}
            return tensors, scalars
    return [], {}


def _torch_param_groups(state: _EngineState) -> list[dict[str, Any]]:
    groups, index = [], 0
    for group, params in zip(state.user_optimizer.param_groups, state.param_groups, strict=True):
        entry = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        entry["params"] = list(range(index, index + len(params)))
        index += len(params)
        groups.append(entry)
    return groups


def _full_optimizer_state(state: _EngineState) -> dict[str, Any] | None:
    engine = state.engine
    if state.stage == 0:
        if engine.optimizer is state.user_optimizer:
            return state.user_optimizer.state_dict()
        logger.warning(
            "DeepSpeed stage 0 wraps the optimizer for mixed precision; its state has no "
            "portable torch form and is not saved (it starts fresh after loading)."
        )
        return None
    from deepspeed.utils import safe_get_full_optimizer_state

    tensor_keys, scalars = _flat_state_keys(engine.optimizer)
    per_param: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(state.params):
        entry: dict[str, Any] = {}
        for key in tensor_keys:  # collective: every rank, same order
            full = safe_get_full_optimizer_state(param, key)
            if full is not None:
                entry[key] = full.detach().reshape(_param_shape(param)).to("cpu", copy=True)
        if entry:
            entry.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
            per_param[index] = entry
    return {"state": per_param, "param_groups": _torch_param_groups(state)}


def _param_shape(param: torch.nn.Parameter) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def _load_model_state(state: _EngineState, model_state: dict[str, torch.Tensor]) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = state.engine.module
    params = list(module.parameters())
    # Stage 3: rank 0's loaded values are broadcast and re-partitioned on exit; every
    # rank loads the same checkpoint, so non-partitioned buffers match as well.
    with deepspeed.zero.GatheredParameters(_zero_params(params), modifier_rank=0):
        module.load_state_dict(model_state)
    if state.stage == 0:
        return
    # ZeRO keeps fp32 master partitions beside the module weights: update them too.
    named = dict(module.named_parameters(remove_duplicate=False))
    for name, param in named.items():
        if name in model_state:
            value = model_state[name].to(torch.float32)
            safe_set_full_fp32_param(param, value.to(_master_device(param, value)))


def _master_device(param: torch.nn.Parameter, value: torch.Tensor) -> torch.device:
    return param.device if param.device.type != "meta" else value.device


def _load_optimizer_state(state: _EngineState, saved: dict[str, Any] | None) -> None:
    if saved is None:
        logger.warning(
            "The checkpoint has no optimizer state; the DeepSpeed optimizer starts fresh."
        )
        return
    if state.stage == 0 and state.engine.optimizer is state.user_optimizer:
        state.user_optimizer.load_state_dict(saved)
        return
    if state.stage == 0:
        logger.warning(
            "DeepSpeed stage 0 with mixed precision cannot take a torch optimizer state; "
            "the optimizer starts fresh."
        )
        return
    from deepspeed.utils import safe_set_full_optimizer_state

    saved_groups = saved.get("param_groups") or []
    if len(saved_groups) != len(state.param_groups) or any(
        len(g["params"]) != len(p) for g, p in zip(saved_groups, state.param_groups, strict=False)
    ):
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes "
            f"{[len(g['params']) for g in saved_groups]}; this optimizer has "
            f"{[len(p) for p in state.param_groups]}. Build the same optimizer as when saving."
        )
    inner = state.engine.optimizer.optimizer
    # Hyperparameters (lr, betas, ...) come from the checkpoint, as in torch's load_state_dict.
    for group, saved_group in zip(state.user_optimizer.param_groups, saved_groups, strict=True):
        group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"})
    per_param = {int(k): v for k, v in (saved.get("state") or {}).items()}
    if not per_param:
        return
    params = state.params
    sample = next(iter(per_param.values()))
    tensor_keys = sorted(k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0)
    scalars = {k: v for k, v in sample.items() if k not in tensor_keys}
    # A fresh ZeRO optimizer has no state yet: create it on the flat partitions, then
    # fill in each parameter's slice.
    for flat in _flat_partitions(state.engine.optimizer):
        entry = inner.state[flat]
        for key in tensor_keys:
            if key not in entry:
                entry[key] = torch.zeros_like(flat)
        for key, value in scalars.items():
            entry[key] = value.clone() if torch.is_tensor(value) else value
    link = getattr(state.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    for index, param in enumerate(params):
        entry = per_param.get(index)
        if not entry:
            continue
        for key in tensor_keys:
            value = entry[key].to(torch.float32).reshape(-1)
            safe_set_full_optimizer_state(param, value, key)
