"""The pieces of the run-config schema: YAML reading, option sections, overrides, messages.

:mod:`polytrain.trainer_api.options.run_config` assembles them into :class:`RunConfig`.
The ``scaling`` / ``failure`` / ``checkpoint`` sections are pydantic models
generated from the dataclasses in :mod:`polytrain.trainer_api.options.configs`, so a
config file accepts exactly what the Python API accepts and the dataclasses'
own checks run on its values.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polytrain.backends.core.step_options import step_options
from polytrain.errors import ConfigError, ConfigTypeError
from polytrain.trainer_api.options.configs import CheckpointConfig, FailureConfig, ScalingConfig

__all__ = [
    "CREATOR_KEYS",
    "DEFAULT_BACKEND",
    "TRAINER_CLASSES",
    "FRAMEWORKS",
    "CheckpointSection",
    "FailureSection",
    "FrameworkSection",
    "ScalingSection",
    "apply_overrides",
    "check_import_path",
    "check_logger_names",
    "config_error_from",
    "merge_framework_section",
    "parse_overrides",
    "plain_data",
    "yaml_load",
]

#: The default backend of each ``trainer:`` value.
DEFAULT_BACKEND = {"torch": "ddp", "tensorflow": "mwms"}
#: Where the trainer class of each ``trainer:`` value lives.
TRAINER_CLASSES = {
    "torch": "polytrain.trainer_api.torch.trainer:TorchTrainer",
    "tensorflow": "polytrain.trainer_api.tensorflow.trainer:TFTrainer",
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


def yaml_load(text: str, source: str) -> Any:
    """Parse YAML text (``1e-3`` is a float).

    Raises:
        ConfigError: the text is not valid YAML; the message names ``source``.
    """
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None


# ------------------------------------------------------------------ sections
def check_import_path(value: str | None) -> str | None:
    """A pydantic field check: ``value`` looks like ``package.module:attribute`` (or is None)."""
    if value is not None and not _IMPORT_PATH.match(value):
        # A ValueError subclass, so pydantic reports it under the field's key path.
        raise ConfigError(
            f"must be an import path such as 'package.module:attribute'; got {value!r}"
        )
    return value


def check_logger_names(value: list[str] | str | None) -> list[str] | str | None:
    """A pydantic field check: every name in ``loggers:`` is a built-in logger."""
    from polytrain.loggers import LOGGER_NAMES

    names = value.split(",") if isinstance(value, str) else value or []
    for name in (n.strip().lower() for n in names):
        if name and name not in LOGGER_NAMES:
            raise ConfigError(f"unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)}")
    return value


def plain_data(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` as plain data: sections given as pydantic models become dicts."""
    return {
        key: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
        for key, value in raw.items()
    }


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


class StepFields(BaseModel):
    """The training step's options of a run config: the TorchTrainer keywords of the same names.

    ``use_fp16`` (alias of ``precision: fp16``), ``max_grad_norm``, ``gradient_accumulation_steps``
    ``precision``, ``activation_checkpointing`` (true or a list of class names) and
    ``compile``: see :class:`~polytrain.backends.core.step_options.StepOptions`.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    use_fp16: bool = False
    max_grad_norm: float | None = None
    gradient_accumulation_steps: int = 1
    precision: str | None = None
    activation_checkpointing: bool | list[str] = False
    compile: bool = False

    @model_validator(mode="after")
    def _step_checks(self) -> StepFields:
        step_options(
            self.max_grad_norm,
            self.gradient_accumulation_steps,
            self.precision,
            self.use_fp16,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
        )
        return self

    def step_kwargs(self) -> dict[str, Any]:
        """The trainer keywords of these fields."""
        return {name: getattr(self, name) for name in StepFields.model_fields}


# --------------------------------------------------------- framework sections
#: The frameworks a run config can carry a section for (``torch:``, ``tensorflow:``).
FRAMEWORKS = ("torch", "tensorflow")


class FrameworkSection(StepFields):
    """A ``torch:`` or ``tensorflow:`` section: one framework's version of the same job.

    It holds what differs between the frameworks (the creators, and options only
    one trainer takes); everything else (``config``, ``num_workers``, ``epochs``,
    ``scaling``, ...) is shared at the top level. Its ``config`` is merged over
    the shared one.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    data: str | None = None
    optimizer: str | None = None
    loss: str | None = None
    scheduler: str | None = None
    operator: str | None = None
    config: dict[str, Any] | None = None
    scheduler_step_freq: Literal["batch", "epoch", "manual"] | None = None
    use_fp16: bool | None = None

    @field_validator(*CREATOR_KEYS)
    @classmethod
    def _import_paths(cls, value: str | None) -> str | None:
        return check_import_path(value)


def _framework_of(backend: Any) -> str | None:
    if not isinstance(backend, str):
        return None
    from polytrain.backends.registry import get_spec

    try:
        return get_spec(backend).framework
    except ConfigError:
        return None  # the backend field's own check reports it


def merge_framework_section(raw: Any) -> Any:
    """The raw run config with the section of the framework in use merged into the top level.

    The framework is ``trainer:`` when set, else the framework of ``backend:``, else
    the only section (``torch`` when there are both). A section's ``config`` is
    merged over the shared ``config``; any other key may be set in one place only.

    Raises:
        ConfigError: the framework in use has no section, or a key is set twice.
    """
    if not isinstance(raw, Mapping):
        return raw
    sections = {fw: raw[fw] for fw in FRAMEWORKS if isinstance(raw.get(fw), Mapping)}
    if not sections:
        return raw
    framework = raw.get("trainer") or _framework_of(raw.get("backend"))
    framework = framework or ("torch" if "torch" in sections else "tensorflow")
    if framework not in sections:
        raise ConfigError(
            f"trainer: this job trains with {framework} (from trainer:/backend:), but the "
            f"config has only a {' and a '.join(sections)}: section; add a {framework}: "
            f"section or pick a {' or '.join(sections)} backend"
        )
    merged = dict(raw)
    merged["trainer"] = framework
    for key, value in sections[framework].items():
        if value is None or key not in FrameworkSection.model_fields:
            continue  # an unknown key is reported inside the section
        if key == "config" and isinstance(value, Mapping):
            merged["config"] = {**(raw.get("config") or {}), **value}
        elif raw.get(key) is not None:
            raise ConfigError(
                f"{key}: set both at the top level and in the {framework}: section; set it "
                f"in one place (the top level holds what both frameworks share)"
            )
        else:
            merged[key] = value
    return merged


# ------------------------------------------------------------------ messages
def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed at key path ``loc`` below the model ``root`` ([] if not a mapping)."""
    model: Any = root
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        # An optional section (``FrameworkSection | None``): the model inside.
        model = next((a for a in typing.get_args(model) if _is_model(a)), model)
    if not _is_model(model):
        return []
    fields = sorted(model.model_fields.items(), key=lambda f: f[0] in StepFields.model_fields)
    return [f.alias or name for name, f in fields]  # own keys first, the step options after


def _format_error(root: type[BaseModel], error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, loc[:-1])
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
        if first and first.group() in _allowed_keys(root, loc):
            path = f"{path}.{first.group()}" if path else first.group()
        return f"{path}: {message}" if path else message
    return f"{path}: {message}; got {type(error['input']).__name__}: {error['input']!r}"


def config_error_from(
    root: type[BaseModel], exc: pydantic.ValidationError, source: str
) -> ConfigError:
    """The :class:`ConfigError` that reports every error of ``exc``, one line each.

    Each line names the key path and what is allowed. When every error is an unknown
    key or a wrong type, it is a :class:`ConfigTypeError`, like Python's own
    ``TypeError`` for an unexpected keyword argument.
    """
    errors = exc.errors(include_url=False)
    lines = "\n".join(f"  - {_format_error(root, e)}" for e in errors)
    typed = all(e["type"] == "extra_forbidden" or e["type"].endswith("_type") for e in errors)
    error = ConfigTypeError if typed else ConfigError
    return error(f"Invalid run config {source}:\n{lines}")


# ----------------------------------------------------------------- overrides
def parse_overrides(overrides: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    """Turn ``["backend=horovod", "config.lr=0.1"]`` into ``{"backend": "horovod", ...}``.

    Values of ``key=value`` strings are YAML scalars (``4`` is an int, ``true`` a bool,
    ``1e-3`` a float, ``null`` None); a mapping's values are used as they are.

    Raises:
        ConfigError: an item that is not ``key=value``.
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
        parsed[key] = yaml_load(value, f"override {item!r}")
    return parsed


def apply_overrides(
    raw: dict[str, Any], overrides: Mapping[str, Any] | Iterable[str] | None
) -> dict[str, Any]:
    """A copy of the raw config mapping with dotted-key overrides set (nested dicts created).

    Raises:
        ConfigError: a key with an empty part, or one that descends into a scalar.
    """
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
