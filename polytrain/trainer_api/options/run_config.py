"""YAML run configs: one file describes a whole training job.

A run config names the creators by import path and holds every trainer option,
so switching backend is a one-line change (or a ``backend=horovod`` override)::

    trainer: torch                  # or: tensorflow
    model: examples.digits:model_creator
    data: examples.digits:data_creator
    optimizer: examples.digits:optimizer_creator
    loss: torch.nn:CrossEntropyLoss
    scheduler: examples.digits:scheduler_creator
    scheduler_step_freq: epoch
    config: {lr: 0.1, batch_size: 64}
    backend: ddp
    num_workers: 2
    epochs: 3
    scaling: {num_cpus_per_worker: 1}
    failure: {max_retries: 1}
    checkpoint: {checkpoint_dir: runs/digits}

The schema is a pydantic model whose ``scaling`` / ``failure`` / ``checkpoint``
sections are generated from the dataclasses in :mod:`polytrain.trainer_api.options.configs`,
so the file accepts exactly what the Python API accepts, and the dataclasses' own
checks run on the values. Errors name the full key path and what is allowed.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from polytrain.backends.core.parallelism import Parallelism
from polytrain.backends.registry import get_spec, resolve_backend_name
from polytrain.compat.omegaconf_values import describe, is_omegaconf, plain_config
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.configs import CheckpointConfig, FailureConfig, ScalingConfig
from polytrain.trainer_api.options.run_config_imports import (
    connect_ray,
    import_object,
    make_importable_on_workers,
    put_cwd_on_path,
    worker_runtime_env,
)
from polytrain.trainer_api.options.run_config_schema import (
    CREATOR_KEYS,
    DEFAULT_BACKEND,
    FRAMEWORKS,
    TRAINER_CLASSES,
    CheckpointSection,
    FailureSection,
    FrameworkSection,
    ScalingSection,
    StepFields,
    apply_overrides,
    check_import_path,
    check_logger_names,
    config_error_from,
    merge_framework_section,
    parse_overrides,
    plain_data,
    yaml_load,
)

__all__ = [
    "CREATOR_KEYS",
    "DEFAULT_BACKEND",
    "TRAINER_CLASSES",
    "RunConfig",
    "connect_ray",
    "import_object",
    "load_config",
    "parse_overrides",
    "trainer_from_config",
    "worker_runtime_env",
]


class RunConfig(StepFields):
    """A validated run config; build the trainer with :meth:`build_trainer`.

    Attributes:
        trainer: "torch" (TorchTrainer) or "tensorflow" (TFTrainer).
        model: import path of the model creator (``package.module:function``).
        data: import path of the data creator.
        optimizer: import path of the optimizer creator.
        loss: import path of a loss class or of a ``config -> loss`` function.
        scheduler: import path of the LR scheduler creator.
        operator: import path of a TrainingOperator subclass.
        config: the user's hyperparameters, passed to every creator.
        backend: backend name or alias; default "ddp" (torch) or "mwms" (tensorflow).
        backend_config: the backend's options (its typed config's fields).
        num_workers: shortcut for ``scaling.num_workers``.
        use_gpu: shortcut for ``scaling.use_gpu``.
        use_fp16: like ``max_grad_norm``, ``gradient_accumulation_steps``, ``precision``,
            ``activation_checkpointing`` and ``compile``, a step option: see :class:`StepFields`.
        use_tqdm: show a progress bar while training.
        epochs: epochs that ``polytrain train`` / ``compare`` run.
        num_steps: at most this many optimizer steps per epoch (None: whole epochs).
        validate: validate after every epoch (needs a validation loader).
        scheduler_step_freq: "batch", "epoch" or "manual".
        scaling: :class:`~polytrain.ScalingConfig` fields.
        failure: :class:`~polytrain.FailureConfig` fields.
        checkpoint: :class:`~polytrain.CheckpointConfig` fields.
        parallelism: the device mesh, ``{dp_replicate: R, dp_shard: S, tp: T}`` (TorchTrainer's
            ``parallelism=``, see docs/parallelism.md).
        tp_plan: ``{module name pattern: style name}``, TorchTrainer's ``tp_plan=``.
        loggers: experiment trackers by name (``[tensorboard, csv]`` or ``"mlflow,csv"``),
            see :mod:`polytrain.loggers`.
        peft_config: TorchTrainer's ``peft_config=`` as a dict with its ``peft_type``
            (``{peft_type: LORA, r: 8, target_modules: [c_attn]}``).
        torch: the torch version of the job (creators, torch-only options), when the
            config carries one for each framework; see :class:`FrameworkSection`.
        tensorflow: the Keras version of the job.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    trainer: Literal["torch", "tensorflow"] = "torch"
    model: str
    data: str
    optimizer: str | None = None
    loss: str | None = None
    scheduler: str | None = None
    operator: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    backend: str | None = None
    backend_config: dict[str, Any] | None = None
    num_workers: int | None = Field(default=None, ge=0)
    use_gpu: bool | None = None
    use_tqdm: bool = False
    epochs: int = Field(default=1, ge=1)
    num_steps: int | None = Field(default=None, ge=1)
    validate_each_epoch: bool = Field(default=True, alias="validate")
    scheduler_step_freq: Literal["batch", "epoch", "manual"] = "batch"
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    failure: FailureSection = Field(default_factory=FailureSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    loggers: list[str] | str | None = None
    peft_config: dict[str, Any] | None = None
    parallelism: dict[str, int] | None = None
    tp_plan: dict[str, str] | None = None
    torch: FrameworkSection | None = None
    tensorflow: FrameworkSection | None = None

    _source: str = PrivateAttr(default="<dict>")
    _raw: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _framework_section(cls, raw: Any) -> Any:
        return merge_framework_section(raw)

    @field_validator(*CREATOR_KEYS)
    @classmethod
    def _import_paths(cls, value: str | None) -> str | None:
        return check_import_path(value)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_backend_name(value)  # UnknownBackendError lists every valid name
        return value

    @field_validator("parallelism")
    @classmethod
    def _mesh_sizes(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        Parallelism.from_value(value)  # unknown keys, sizes < 1 other than -1
        return value

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, value: list[str] | str | None) -> list[str] | str | None:
        return check_logger_names(value)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.backend is None:
            self.backend = DEFAULT_BACKEND[self.trainer]
        spec = get_spec(self.backend)
        if spec.framework != self.trainer:
            raise ConfigError(
                f"backend: '{self.backend}' is a {spec.framework} backend, but trainer is "
                f"'{self.trainer}'; set trainer: {spec.framework} or pick one of the "
                f"{self.trainer} backends"
            )
        for flat in ("num_workers", "use_gpu"):
            if getattr(self, flat) is not None and flat in self.scaling.model_fields_set:
                raise ConfigError(
                    f"{flat}: set both at the top level and as scaling.{flat}; set it in one place"
                )
        if self.trainer == "torch" and self.optimizer is None:
            raise ConfigError(
                "optimizer: required for trainer 'torch' (an import path such as "
                "'examples.digits:optimizer_creator')"
            )
        return self

    # ------------------------------------------------------------ views
    @property
    def source(self) -> str:
        """Where the config came from (a file path, or "<dict>"), for messages."""
        return self._source

    @property
    def frameworks(self) -> tuple[str, ...]:
        """The frameworks this config can train: those with a section, else ``(trainer,)``."""
        with_section = tuple(fw for fw in FRAMEWORKS if getattr(self, fw) is not None)
        return with_section or (self.trainer,)

    def with_backend(self, backend: str, **overrides: Any) -> RunConfig:
        """This job on another backend; with framework sections, also another framework.

        The backend's options (``backend_config``) belong to the configured backend,
        so another backend starts from its defaults.
        """
        values: dict[str, Any] = {"backend": backend, **overrides}
        if get_spec(backend).name != self.backend_name:
            values["backend_config"] = None
        if len(self.frameworks) > 1:
            values["trainer"] = get_spec(backend).framework
        return self.with_overrides(values)

    @property
    def backend_name(self) -> str:
        """The canonical name of the configured backend."""
        return get_spec(self.backend).name

    def scaling_config(self) -> ScalingConfig:
        """The :class:`ScalingConfig`, with the top-level shortcuts folded in."""
        values = self.scaling.model_dump()
        for flat in ("num_workers", "use_gpu"):
            if getattr(self, flat) is not None:
                values[flat] = getattr(self, flat)
        return ScalingConfig(**values)

    def failure_config(self) -> FailureConfig:
        """The :class:`FailureConfig` of the ``failure:`` section."""
        return self.failure.build()

    def checkpoint_config(self) -> CheckpointConfig:
        """The :class:`CheckpointConfig` of the ``checkpoint:`` section."""
        return self.checkpoint.build()

    def to_dict(self) -> dict[str, Any]:
        """The keys the config sets, as plain data: saved next to a run, it loads again."""
        if self._raw is not None:
            # As written (framework sections unmerged), with the backend in use.
            return {**self._raw, "backend": self.backend}
        return {
            **self.model_dump(by_alias=True, mode="json", exclude_unset=True),
            "backend": self.backend,
        }

    def with_overrides(self, overrides: Mapping[str, Any] | Iterable[str]) -> RunConfig:
        """A new config with dotted-key overrides applied (see :func:`load_config`)."""
        if self._raw is not None:
            raw = {**self._raw, "backend": self.backend}
        else:
            raw = self.model_dump(by_alias=True, exclude_unset=True)
            raw["backend"] = self.backend
        return _validate(apply_overrides(raw, overrides), self.source)

    # ------------------------------------------------------------ build
    def resolve_creators(self) -> dict[str, Any]:
        """Import the creators; returns trainer keyword arguments (``model_creator``, ...).

        Import paths resolve relative to the current working directory, which is put
        on ``sys.path`` first.
        """
        put_cwd_on_path()
        return {
            kwarg: import_object(getattr(self, key), key)
            for key, kwarg in CREATOR_KEYS.items()
            if getattr(self, key) is not None
        }

    def trainer_kwargs(self, trainer_cls: type) -> dict[str, Any]:
        """Keyword arguments for ``trainer_cls(...)``; rejects options it does not take."""
        always = {
            **self.resolve_creators(),
            "config": dict(self.config),
            "backend": self.backend,
            "backend_config": self.backend_config,
            "scaling_config": self.scaling_config(),
            "failure_config": self.failure_config(),
            "checkpoint_config": self.checkpoint_config(),
        }
        # Passed only where the trainer takes them, unless the config sets them.
        optional = {
            **self.step_kwargs(),
            "use_tqdm": self.use_tqdm,
            "scheduler_step_freq": self.scheduler_step_freq,
            "loggers": self.loggers,
            "peft_config": self.peft_config,
            "parallelism": self.parallelism,
            "tp_plan": self.tp_plan,
        }
        params = inspect.signature(trainer_cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        config_key = {v: k for k, v in CREATOR_KEYS.items()}
        kwargs: dict[str, Any] = {}
        for name, value in {**always, **optional}.items():
            if takes_any or name in params:
                kwargs[name] = value
            elif name in always or name in self.model_fields_set:
                raise ConfigTypeError(
                    f"{config_key.get(name, name)}: {trainer_cls.__name__} does not take this "
                    f"option (it takes: {', '.join(params)}); remove it from the config."
                )
        return kwargs

    def build_trainer(self, trainer_cls: type | None = None, **replace: Any) -> Any:
        """Import the creators, connect to Ray and construct the trainer (workers start).

        Args:
            trainer_cls: the trainer class; default from ``trainer:`` (TorchTrainer or
                TFTrainer). It must belong to the config's framework.
            **replace: trainer arguments that replace the config's (e.g. ``loggers=`` with
                Logger instances writing into a run directory).
        """
        trainer_cls = trainer_cls or import_object(TRAINER_CLASSES[self.trainer], "trainer")
        framework = getattr(trainer_cls, "framework", self.trainer)
        if framework != self.trainer:
            raise ConfigError(
                f"trainer: the config says '{self.trainer}' but {trainer_cls.__name__} trains "
                f"{framework} models; set trainer: {framework} or use the matching trainer class."
            )
        self._check_backend_config()
        kwargs = {**self.trainer_kwargs(trainer_cls), **replace}
        scaling = self.scaling_config()
        if not scaling.local_mode:
            connect_ray(scaling.address)
            make_importable_on_workers(kwargs.values())
        return trainer_cls(**kwargs)

    def _check_backend_config(self) -> None:
        from polytrain.backends.registry import get_backend_class

        backend_cls = get_backend_class(self.backend, self.trainer)
        try:
            backend_cls.config_cls.from_value(self.backend_config, self.backend_name)
        except (TypeError, ValueError) as exc:
            # An unknown key or a wrong type stays a TypeError (ConfigTypeError).
            error = ConfigTypeError if isinstance(exc, TypeError) else ConfigError
            raise error(f"Invalid run config {self.source}:\n  - backend_config: {exc}") from None


# ---------------------------------------------------------------- loading
def _validate(raw: Any, source: str) -> RunConfig:
    raw = plain_config(raw, f"run config {source}")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} must be a mapping of run-config keys (model:, data:, backend:, ...); "
            f"got {type(raw).__name__}: {raw!r}."
        )
    try:
        run = RunConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise config_error_from(RunConfig, exc, source) from None
    run._source = source
    run._raw = plain_data(raw)
    return run


def load_config(
    path: str | os.PathLike | Mapping[str, Any],
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> RunConfig:
    """Read and validate a YAML run config, applying dotted-key overrides.

    Example (a Hydra app whose ``trainer:`` section holds run-config keys)::

        @hydra.main(version_base=None, config_path="conf", config_name="config")
        def main(cfg: DictConfig) -> None:
            trainer = polytrain.load_config(cfg.trainer).build_trainer()

    Args:
        path: the YAML file, or the run config's keys as a mapping: a dict or an
            OmegaConf ``DictConfig`` (interpolations are resolved, ``ListConfig``
            values become lists).
        overrides: ``["backend=horovod", "num_workers=4", "config.lr=0.1"]`` (values are
            YAML scalars) or a mapping ``{"config.lr": 0.1}``.

    Raises:
        ConfigError: a missing file, bad YAML, or keys/values the schema rejects; the
            message names each key path and what is allowed. For a ``DictConfig``, a
            missing (``???``) or unresolvable value, named by its key.
    """
    if isinstance(path, Mapping) or is_omegaconf(path):
        source = describe(path)
        raw = plain_config(path, f"run config {source}")
        if isinstance(raw, Mapping):
            raw = apply_overrides(dict(raw), overrides)
        return _validate(raw, source)  # not a mapping (a ListConfig): says so
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"Run config {str(file)!r} does not exist (or is not a file).")
    raw = yaml_load(file.read_text(), str(file))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{file} must hold a mapping of run-config keys (model:, data:, backend:, ...); "
            f"got {type(raw).__name__}."
        )
    return _validate(apply_overrides(raw, overrides), str(file))


def trainer_from_config(
    path_or_config: str | os.PathLike | Mapping[str, Any] | RunConfig,
    trainer_cls: type | None = None,
    **overrides: Any,
) -> Any:
    """Build a trainer from a YAML run config (or a :class:`RunConfig`).

    Example:
        >>> trainer = trainer_from_config("examples/configs/ddp.yaml", backend="horovod",
        ...                               **{"config.lr": 0.05})

    Args:
        path_or_config: a YAML file, a loaded :class:`RunConfig`, or the run config's
            keys as a dict or an OmegaConf ``DictConfig`` (a Hydra app's section).
        trainer_cls: the trainer class (default: from the config's ``trainer:``).
        **overrides: dotted keys, e.g. ``num_workers=4`` or ``**{"config.lr": 0.1}``.
    """
    if isinstance(path_or_config, RunConfig):
        run = path_or_config.with_overrides(overrides) if overrides else path_or_config
    else:
        run = load_config(path_or_config, overrides)
    return run.build_trainer(trainer_cls)
