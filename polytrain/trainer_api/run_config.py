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
sections are generated from the dataclasses in :mod:`polytrain.trainer_api.config`,
so the file accepts exactly what the Python API accepts, and the dataclasses' own
checks run on the values. Errors name the full key path and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from polytrain.backends.registry import get_spec, resolve_backend_name
from polytrain.errors import ConfigError
from polytrain.trainer_api.config import CheckpointConfig, FailureConfig, ScalingConfig

__all__ = ["RunConfig", "load_config", "parse_overrides", "trainer_from_config"]

#: The default backend of each ``trainer:`` value.
DEFAULT_BACKEND = {"torch": "ddp", "tensorflow": "mwms"}
#: Where the trainer class of each ``trainer:`` value lives.
TRAINER_CLASSES = {
    "torch": "polytrain.trainer_api.torch_trainer:TorchTrainer",
    "tensorflow": "polytrain.trainer_api.tf_trainer:TFTrainer",
}
#: Run-config key -> trainer keyword argument, for the creators.
CREATOR_KEYS = {
    "model": "model_creator",
    "data": "data_creator",
    "optimizer": "optimizer_creator",
    "loss": "loss_creator",
    "scheduler": "scheduler_creator",
    "operator": "training_operator_cls",
}

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")


# --------------------------------------------------------------------- YAML
class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.2), not as a string.

    PyYAML implements YAML 1.1, whose float pattern needs a dot; learning rates
    written as ``1e-3`` would otherwise arrive in ``config`` as strings.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_load(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None


# ------------------------------------------------------------------- schema
def _check_import_path(value: str | None) -> str | None:
    if value is not None and not _IMPORT_PATH.match(value):
        raise ValueError(
            f"must be an import path such as 'package.module:attribute'; got {value!r}"
        )
    return value


class _Section(BaseModel):
    """A config section generated from one of the option dataclasses."""

    model_config = ConfigDict(extra="forbid", strict=True)
    target: ClassVar[type]

    @model_validator(mode="after")
    def _dataclass_checks(self) -> _Section:
        # The dataclass's __post_init__ holds the range and choice checks.
        self.build()
        return self

    def build(self) -> Any:
        """The option dataclass with this section's values."""
        return self.target(**self.model_dump())


def _section_model(cls: type) -> type[_Section]:
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=field.default_factory)
        else:  # pragma: no cover - every option field has a default
            default = ...
        fields[field.name] = (hints[field.name], default)
    model = pydantic.create_model(
        f"{cls.__name__}Section", __base__=_Section, __doc__=cls.__doc__, **fields
    )
    model.target = cls
    return model


ScalingSection = _section_model(ScalingConfig)
FailureSection = _section_model(FailureConfig)
CheckpointSection = _section_model(CheckpointConfig)


class RunConfig(BaseModel):
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
        use_fp16: mixed precision.
        use_tqdm: show a progress bar while training.
        epochs: epochs that ``polytrain train`` / ``compare`` run.
        num_steps: train at most this many batches per epoch (None: whole epochs).
        validate: validate after every epoch (needs a validation loader).
        scheduler_step_freq: "batch", "epoch" or "manual".
        scaling: :class:`~polytrain.ScalingConfig` fields.
        failure: :class:`~polytrain.FailureConfig` fields.
        checkpoint: :class:`~polytrain.CheckpointConfig` fields.
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
    use_fp16: bool = False
    use_tqdm: bool = False
    epochs: int = Field(default=1, ge=1)
    num_steps: int | None = Field(default=None, ge=1)
    validate_each_epoch: bool = Field(default=True, alias="validate")
    scheduler_step_freq: Literal["batch", "epoch", "manual"] = "batch"
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    failure: FailureSection = Field(default_factory=FailureSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    _source: str = PrivateAttr(default="<dict>")

    @field_validator(*CREATOR_KEYS)
    @classmethod
    def _import_paths(cls, value: str | None) -> str | None:
        return _check_import_path(value)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_backend_name(value)  # UnknownBackendError lists every valid name
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.backend is None:
            self.backend = DEFAULT_BACKEND[self.trainer]
        spec = get_spec(self.backend)
        if spec.framework != self.trainer:
            raise ValueError(
                f"backend: '{self.backend}' is a {spec.framework} backend, but trainer is "
                f"'{self.trainer}'; set trainer: {spec.framework} or pick one of the "
                f"{self.trainer} backends"
            )
        for flat in ("num_workers", "use_gpu"):
            if getattr(self, flat) is not None and flat in self.scaling.model_fields_set:
                raise ValueError(
                    f"{flat}: set both at the top level and as scaling.{flat}; set it in one place"
                )
        if self.trainer == "torch" and self.optimizer is None:
            raise ValueError(
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
        return {
            **self.model_dump(by_alias=True, mode="json", exclude_unset=True),
            "backend": self.backend,
        }

    def with_overrides(self, overrides: Mapping[str, Any] | Iterable[str]) -> RunConfig:
        """A new config with dotted-key overrides applied (see :func:`load_config`)."""
        raw = self.model_dump(by_alias=True, exclude_unset=True)
        raw["backend"] = self.backend
        return _validate(_apply_overrides(raw, overrides), self.source)

    # ------------------------------------------------------------ build
    def resolve_creators(self) -> dict[str, Any]:
        """Import the creators; returns trainer keyword arguments (``model_creator``, ...).

        Import paths resolve relative to the current working directory, which is put
        on ``sys.path`` first.
        """
        _put_cwd_on_path()
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
            "use_fp16": self.use_fp16,
            "use_tqdm": self.use_tqdm,
            "scheduler_step_freq": self.scheduler_step_freq,
        }
        params = inspect.signature(trainer_cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        config_key = {v: k for k, v in CREATOR_KEYS.items()}
        kwargs: dict[str, Any] = {}
        for name, value in {**always, **optional}.items():
            if takes_any or name in params:
                kwargs[name] = value
            elif name in always or name in self.model_fields_set:
                raise ConfigError(
                    f"{config_key.get(name, name)}: {trainer_cls.__name__} does not take this "
                    f"option (it takes: {', '.join(params)}); remove it from the config."
                )
        return kwargs

    def build_trainer(self, trainer_cls: type | None = None) -> Any:
        """Import the creators, connect to Ray and construct the trainer (workers start).

        Args:
            trainer_cls: the trainer class; default from ``trainer:`` (TorchTrainer or
                TFTrainer). It must belong to the config's framework.
        """
        trainer_cls = trainer_cls or import_object(TRAINER_CLASSES[self.trainer], "trainer")
        framework = getattr(trainer_cls, "framework", self.trainer)
        if framework != self.trainer:
            raise ConfigError(
                f"trainer: the config says '{self.trainer}' but {trainer_cls.__name__} trains "
                f"{framework} models; set trainer: {framework} or use the matching trainer class."
            )
        self._check_backend_config()
        kwargs = self.trainer_kwargs(trainer_cls)
        scaling = self.scaling_config()
        if not scaling.local_mode:
            connect_ray(scaling.address)
            _make_importable_on_workers(kwargs.values())
        return trainer_cls(**kwargs)

    def _check_backend_config(self) -> None:
        from polytrain.backends.registry import get_backend_class

        backend_cls = get_backend_class(self.backend, self.trainer)
        try:
            backend_cls.config_cls.from_value(self.backend_config, self.backend_name)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"Invalid run config {self.source}:\n  - backend_config: {exc}"
            ) from None


# ---------------------------------------------------------------- loading
def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _format_error(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{path}: unknown key{hint}; allowed: {', '.join(allowed)}"
    if kind == "missing":
        return f"{path}: required, but missing"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind in ("value_error", "assertion_error"):
        # The option dataclasses' checks start with the field's name: point at it.
        first = re.match(r"\w+", message)
        if first and message.startswith(f"{first.group()}:") and not path:
            return message
        if first and first.group() in _allowed_keys(loc):
            path = f"{path}.{first.group()}" if path else first.group()
        return f"{path}: {message}" if path else message
    return f"{path}: {message}; got {type(error['input']).__name__}: {error['input']!r}"


def _validate(raw: Any, source: str) -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} must be a mapping of run-config keys (model:, data:, backend:, ...); "
            f"got {type(raw).__name__}: {raw!r}."
        )
    try:
        run = RunConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        lines = "\n".join(f"  - {_format_error(e)}" for e in exc.errors(include_url=False))
        raise ConfigError(f"Invalid run config {source}:\n{lines}") from None
    run._source = source
    return run


def parse_overrides(overrides: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    """Turn ``["backend=horovod", "config.lr=0.1"]`` into ``{"backend": "horovod", ...}``.

    Values of ``key=value`` strings are YAML scalars (``4`` is an int, ``true`` a bool,
    ``1e-3`` a float, ``null`` None); a mapping's values are used as they are.
    """
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"Override {item!r} must look like key=value, e.g. backend=horovod or "
                f"config.lr=0.1."
            )
        parsed[key] = _yaml_load(value, f"override {item!r}")
    return parsed


def _apply_overrides(
    raw: dict[str, Any], overrides: Mapping[str, Any] | Iterable[str] | None
) -> dict[str, Any]:
    raw = dict(raw)
    for dotted, value in parse_overrides(overrides).items():
        parts = dotted.split(".")
        if not all(parts):
            raise ConfigError(f"Override key {dotted!r} has an empty part; use e.g. config.lr.")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif isinstance(child, BaseModel):
                child = child.model_dump(exclude_unset=True)
            elif not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(
                    f"Override {dotted}={value!r}: {where} is {child!r}, not a mapping, so it "
                    f"has no key '{parts[depth + 1]}'."
                )
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return raw


def load_config(
    path: str | os.PathLike, overrides: Mapping[str, Any] | Iterable[str] | None = None
) -> RunConfig:
    """Read and validate a YAML run config, applying dotted-key overrides.

    Args:
        path: the YAML file.
        overrides: ``["backend=horovod", "num_workers=4", "config.lr=0.1"]`` (values are
            YAML scalars) or a mapping ``{"config.lr": 0.1}``.

    Raises:
        ConfigError: a missing file, bad YAML, or keys/values the schema rejects; the
            message names each key path and what is allowed.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"Run config {str(file)!r} does not exist (or is not a file).")
    raw = _yaml_load(file.read_text(), str(file))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{file} must hold a mapping of run-config keys (model:, data:, backend:, ...); "
            f"got {type(raw).__name__}."
        )
    return _validate(_apply_overrides(raw, overrides), str(file))


def trainer_from_config(
    path_or_config: str | os.PathLike | RunConfig,
    trainer_cls: type | None = None,
    **overrides: Any,
) -> Any:
    """Build a trainer from a YAML run config (or a :class:`RunConfig`).

    Example:
        >>> trainer = trainer_from_config("examples/configs/ddp.yaml", backend="horovod",
        ...                               **{"config.lr": 0.05})

    Args:
        path_or_config: a YAML file or a loaded :class:`RunConfig`.
        trainer_cls: the trainer class (default: from the config's ``trainer:``).
        **overrides: dotted keys, e.g. ``num_workers=4`` or ``**{"config.lr": 0.1}``.
    """
    if isinstance(path_or_config, RunConfig):
        run = path_or_config.with_overrides(overrides) if overrides else path_or_config
    else:
        run = load_config(path_or_config, overrides)
    return run.build_trainer(trainer_cls)


# ------------------------------------------------------------- importing
def _put_cwd_on_path() -> str:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def import_object(path: str, key: str = "import path") -> Any:
    """Import ``package.module:attr`` (or ``package.module.attr``).

    Raises:
        ConfigError: naming the config key, the path and why it failed.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{key}: {path!r} is not an import path; write 'package.module:attribute'."
        )
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}: cannot import module '{module_name}' of {path!r} ({type(exc).__name__}: "
            f"{exc}). Paths resolve relative to the current directory ({os.getcwd()}) and "
            f"sys.path; run from your project root or install the package."
        ) from exc
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            names = [n for n in dir(value) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"{key}: '{module_name}' has no attribute '{attr}' (from {path!r}).{hint}"
            ) from None
    return value


def worker_runtime_env() -> dict[str, Any] | None:
    """A Ray runtime_env that lets workers import the creators' modules from the cwd.

    Inside a Ray job whose runtime_env ships a working_dir or py_modules, the
    workers can import them already and no change is needed.
    """
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if job:
        job_env = (json.loads(job).get("runtime_env") or {}) if job else {}
        if job_env.get("working_dir") or job_env.get("py_modules"):
            return None
        if "PYTHONPATH" in (job_env.get("env_vars") or {}):
            return None  # merging would conflict; the job chose its own path
    paths = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def connect_ray(address: str | None = None) -> None:
    """Connect to Ray (the running instance, ``address``, or a new local one).

    Like :func:`polytrain.launchers.worker_group.ensure_ray`, and in addition the
    workers get the current directory on their ``PYTHONPATH``, so creators given as
    import paths relative to it (``examples.digits:model_creator``) load there too.
    Does nothing when Ray is already initialized.
    """
    from polytrain.launchers.worker_group import ensure_ray

    ensure_ray(address, runtime_env=worker_runtime_env())


def _make_importable_on_workers(objects: Iterable[Any]) -> None:
    """Ship creators from cwd modules by value when Ray's workers cannot import them.

    A Ray instance started elsewhere (``ray.init()`` in a notebook) may not have the
    current directory on its workers' path; cloudpickle then sends those modules'
    code along instead of a reference.
    """
    import ray
    from ray import cloudpickle

    cwd = os.getcwd()
    env = ray.get_runtime_context().runtime_env or {}
    worker_paths = (env.get("env_vars") or {}).get("PYTHONPATH", "").split(os.pathsep)
    if env.get("working_dir") or env.get("py_modules") or cwd in worker_paths:
        return
    installed = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)]
    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        file = Path(getattr(module, "__file__", None) or "/").resolve()
        root = (module.__name__ if module else "").split(".")[0]
        if (
            root
            and root != "polytrain"
            and file.is_relative_to(Path(cwd).resolve())
            and not any(file.is_relative_to(p) for p in installed)
        ):
            try:
                cloudpickle.register_pickle_by_value(sys.modules[root])
            except ValueError:  # pragma: no cover - already registered
                pass
