"""Validate the creator functions when the trainer is built, and what they return on the workers."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polytrain.errors import CreatorError, CreatorTypeError
from polytrain.hf import adapters

if TYPE_CHECKING:
    import torch

_SIGNATURES = {
    "model_creator": "model_creator(config) -> nn.Module (or a tuple of them)",
    "data_creator": "data_creator(config) -> train DataLoader, or (train_loader, val_loader)",
    "optimizer_creator": "optimizer_creator(model, config) -> torch.optim.Optimizer (or a tuple)",
    "loss_creator": "loss_creator: a loss class such as torch.nn.CrossEntropyLoss, or loss_creator(config) -> callable",
    "scheduler_creator": "scheduler_creator(optimizer, config) -> LR scheduler (or a tuple)",
}


def _describe(value: Any) -> str:
    text = " ".join(repr(value).split())  # one line, also for multi-line reprs
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} ({text})"


# What each creator is called with on the workers, config always last.
_ARGUMENTS = {
    "model_creator": ("config",),
    "data_creator": ("config",),
    "loss_creator": ("config",),
    "optimizer_creator": ("model", "config"),
    "scheduler_creator": ("optimizer", "config"),
}


def check_callable(
    name: str, fn: Any, num_args: int, required: bool = True, expected: str | None = None
) -> None:
    """Raise a :class:`CreatorTypeError` unless ``fn`` can be called with ``num_args`` positionals.

    Also refused: a function whose last positional slot, where ``config`` goes, is a
    parameter with a default that is not a dict (``resnet18(pretrained=False)``,
    ``make_net(num_classes=10)``): called as ``fn(config)`` it would take the dict
    for that parameter and fail far from the cause. The message shows the one-line
    ``lambda`` that wraps it. ``expected`` is the signature the messages show
    (default: the torch trainer's for ``name``).
    """
    expected = expected or _SIGNATURES.get(name, name)
    if fn is None:
        if required:
            raise CreatorTypeError(f"{name} is required: {expected}.")
        return
    if not callable(fn):
        raise CreatorTypeError(f"{name} must be callable: {expected}; got {_describe(fn)}.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C extensions: nothing to check before the call
    arguments = _ARGUMENTS.get(name, (*(f"arg{i}" for i in range(num_args - 1)), "config"))
    call = f"{name}({', '.join(arguments)})"
    try:
        bound = signature.bind(*range(num_args))
    except TypeError as exc:
        raise CreatorTypeError(
            f"{name} {_qualname(fn)}{signature} cannot be called with {num_args} argument(s) "
            f"({exc}): polytrain calls {call} on every worker. Wrap it in a one-line "
            f"function, for example {name}={_wrapper(name, fn, signature, arguments)}. "
            f"Expected {expected}."
        ) from None
    slot = _config_parameter(signature, bound, num_args - 1)
    if slot is not None:
        raise CreatorTypeError(
            f"{name} {_qualname(fn)}{signature} would receive the config dict as its "
            f"argument {slot.name!r} (default {slot.default!r}): polytrain calls {call} on "
            f"every worker. Wrap it in a one-line function, for example "
            f"{name}={_wrapper(name, fn, signature, arguments)}. "
            f"Expected {expected}."
        )


def _qualname(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", fn))


def _config_parameter(
    signature: inspect.Signature, bound: inspect.BoundArguments, index: int
) -> inspect.Parameter | None:
    """The parameter that would take ``config`` when its default says it means something else."""
    for name, value in bound.arguments.items():
        parameter = signature.parameters[name]
        if parameter.kind is parameter.VAR_POSITIONAL or value != index:
            continue
        return None if _may_take_config(parameter) else parameter
    return None


def _may_take_config(parameter: inspect.Parameter) -> bool:
    # No default, None or a dict: how creators spell a (maybe optional) config.
    default = parameter.default
    return default is parameter.empty or default is None or isinstance(default, Mapping)


def _wrapper(name: str, fn: Any, signature: inspect.Signature, arguments: tuple[str, ...]) -> str:
    """``lambda <the creator's arguments>: fn(<those fn takes positionally>, <its own>)``.

    ``config`` is passed on only when ``fn`` takes it positionally without a default.
    """
    fn_name = getattr(fn, "__name__", "")
    if not fn_name.isidentifier():  # a lambda or a partial: only the arguments can be shown
        body = "<its body>" if fn_name == "<lambda>" else "..."
        return f"lambda {', '.join(arguments)}: {body}"
    parameters = list(signature.parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    count = len(arguments) if takes_varargs else min(len(arguments), len(positional))
    if count == len(arguments) and count <= len(positional):
        if not _may_take_config(positional[count - 1]):
            count -= 1  # its last positional slot means something else: config stays out
    passed = list(arguments[:count])
    if name == "optimizer_creator" and inspect.isclass(fn):
        # An optimizer class: it takes the parameters, not the module.
        return f"lambda {', '.join(arguments)}: {fn_name}(model.parameters(), lr=config['lr'])"
    rest = positional[count:] + [p for p in parameters if p.kind is p.KEYWORD_ONLY]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters)
    if name == "model_creator" and ("num_classes" in signature.parameters or takes_kwargs):
        # Model builders (torchvision's among them) take the class count as a keyword.
        passed.append("num_classes=10")
    elif rest or takes_kwargs:
        passed.append("...")
    return f"lambda {', '.join(arguments)}: {fn_name}({', '.join(passed)})"


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


class Created(tuple):
    """The objects a creator built, as a tuple that remembers what the creator returned.

    The next creator receives exactly that object (RaySGD's rule): the model when
    one was returned, the same list when a list was, the same tuple (or named
    tuple) when a tuple was.
    """

    returned: Any = None  # the creator's return value itself

    def __new__(cls, items: Any, returned: Any = None) -> Created:
        created = super().__new__(cls, items)
        created.returned = created[0] if returned is None and len(created) == 1 else returned
        return created

    def as_returned(self) -> Any:
        """The creator's return value, the very object it returned."""
        return self.returned


def check_return(name: str, value: Any, expected: type | tuple[type, ...], what: str) -> Created:
    """Validate a creator's return value; returns the created objects as a :class:`Created` tuple."""
    items = _as_tuple(value)
    if not items or not all(isinstance(item, expected) for item in items):
        raise CreatorTypeError(
            f"{name} returned {_describe(value)}; expected {what}. "
            f"Signature: {_SIGNATURES.get(name, name)}."
        )
    return Created(items, value)


def _check_not_instance(name: str, value: Any, kind: type, how: str) -> None:
    """Refuse a built object where a function that builds it belongs (``model_creator=MyNet()``)."""
    if isinstance(value, kind):
        raise CreatorTypeError(
            f"{name} received {_describe(value)}, an instance; polytrain needs a function that "
            f"builds it on every worker. Write {how}. Signature: {_SIGNATURES[name]}."
        )


@dataclass
class TorchCreators:
    """The user's creator functions for a :class:`~polytrain.TorchTrainer`.

    Validated on construction (callable, takes the right arguments); the ``create_*``
    methods run on the workers and validate what each creator returns.
    """

    model_creator: Callable[[dict], Any]
    data_creator: Callable[[dict], Any]
    optimizer_creator: Callable[[Any, dict], Any]
    loss_creator: Any = None
    scheduler_creator: Callable[[Any, dict], Any] | None = None
    #: ``peft_config=``: the model is wrapped by ``peft.get_peft_model`` wherever it is built.
    peft_config: Any = None

    def __post_init__(self) -> None:
        self._check_instances()
        check_callable("model_creator", self.model_creator, 1)
        check_callable("data_creator", self.data_creator, 1)
        check_callable("optimizer_creator", self.optimizer_creator, 2)
        check_callable("scheduler_creator", self.scheduler_creator, 2, required=False)
        if self.loss_creator is not None and not (
            inspect.isclass(self.loss_creator) or callable(self.loss_creator)
        ):
            raise CreatorTypeError(
                f"loss_creator must be a loss class or a callable; got "
                f"{_describe(self.loss_creator)}. {_SIGNATURES['loss_creator']}."
            )
        if self.loss_creator is not None and not inspect.isclass(self.loss_creator):
            check_callable("loss_creator", self.loss_creator, 1)
        self.peft_config = adapters.resolve_peft_config(self.peft_config)
        if self.peft_config is not None:
            self.model_creator = adapters.PeftCreator(self.model_creator, self.peft_config)

    def _check_instances(self) -> None:
        import torch

        _check_not_instance(
            "model_creator",
            self.model_creator,
            torch.nn.Module,
            f"model_creator=lambda config: {type(self.model_creator).__name__}(...) (or a "
            f"def that returns a new model)",
        )
        _check_not_instance(
            "optimizer_creator",
            self.optimizer_creator,
            torch.optim.Optimizer,
            f"optimizer_creator=lambda model, config: torch.optim."
            f"{type(self.optimizer_creator).__name__}(model.parameters(), lr=config['lr'])",
        )
        _check_not_instance(
            "data_creator",
            self.data_creator,
            (torch.utils.data.DataLoader, torch.utils.data.Dataset),
            "data_creator=lambda config: DataLoader(dataset, batch_size=config['batch_size']) "
            "(or return the Dataset from the function: it is batched for you)",
        )
        if isinstance(self.loss_creator, torch.nn.Module):
            raise CreatorTypeError(
                f"loss_creator received {_describe(self.loss_creator)}, an instance; pass the "
                f"class (loss_creator={type(self.loss_creator).__name__}) or a function "
                f"config -> loss. {_SIGNATURES['loss_creator']}."
            )

    def create_models(self, config: dict) -> Created:
        """Call ``model_creator`` and check it built modules."""
        import torch

        return check_return(
            "model_creator",
            self.model_creator(config),
            torch.nn.Module,
            "a torch.nn.Module or a tuple of them",
        )

    def create_optimizers(self, models: tuple[torch.nn.Module, ...], config: dict) -> Created:
        """Call ``optimizer_creator`` with the models as ``model_creator`` returned them."""
        import torch

        return check_return(
            "optimizer_creator",
            self.optimizer_creator(_as_returned(models), config),
            torch.optim.Optimizer,
            "a torch.optim.Optimizer or a tuple of them",
        )

    def create_schedulers(self, optimizers: tuple[Any, ...], config: dict) -> tuple[Any, ...]:
        """Call ``scheduler_creator`` (if any) with the optimizers as ``optimizer_creator`` returned them."""
        if self.scheduler_creator is None:
            return ()
        value = self.scheduler_creator(_as_returned(optimizers), config)
        schedulers = _as_tuple(value)
        if not schedulers or not all(
            hasattr(s, "step") and hasattr(s, "state_dict") for s in schedulers
        ):
            raise CreatorTypeError(
                f"scheduler_creator returned {_describe(value)}; expected a learning-rate "
                f"scheduler (an object with step() and state_dict(), e.g. "
                f"torch.optim.lr_scheduler.StepLR) or a tuple of them."
            )
        return schedulers

    def create_loss(self, config: dict) -> Callable | None:
        """Instantiate the loss class, or call the loss creator with ``config``."""
        if self.loss_creator is None:
            return None
        if inspect.isclass(self.loss_creator):
            loss = self.loss_creator()
        else:
            loss = self.loss_creator(config)
        if not callable(loss):
            raise CreatorTypeError(
                f"loss_creator returned {_describe(loss)}; expected a callable loss "
                f"(output, target) -> tensor. {_SIGNATURES['loss_creator']}."
            )
        return loss

    def create_data(self, config: dict) -> tuple[Any, Any]:
        """Call ``data_creator``; returns ``(train_loader, val_loader or None)``.

        A ``Dataset`` (map-style) is wrapped in a ``DataLoader`` with the per-worker
        ``config["batch_size"]``, shuffled for training; the trainer then gives it the
        distributed sampler like any loader.
        """
        import torch

        value = self.data_creator(config)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            value = type(value)(
                _loader_for(v, config, training=i == 0) for i, v in enumerate(value)
            )
        else:
            value = _loader_for(value, config, training=True)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            train, val = value
        elif isinstance(value, (tuple, list)):
            raise CreatorError(
                f"data_creator returned a {type(value).__name__} of {len(value)} items; expected "
                f"a train DataLoader or a (train_loader, val_loader) pair."
            )
        else:
            train, val = value, None
        for label, loader in (("train loader", train), ("validation loader", val)):
            if loader is None and label == "validation loader":
                continue
            if not isinstance(loader, Iterable) or isinstance(
                loader, (str, bytes, dict, torch.Tensor)
            ):
                raise CreatorTypeError(
                    f"data_creator returned {_describe(loader)} as its {label}; expected a "
                    f"torch.utils.data.DataLoader (or another iterable of batches)."
                )
        return train, val


def _as_returned(created: tuple[Any, ...]) -> Any:
    if isinstance(created, Created):
        return created.as_returned()
    return created[0] if len(created) == 1 else created  # a plain tuple from older callers


def _loader_for(value: Any, config: dict, training: bool) -> Any:
    """Wrap a map-style ``Dataset`` in a ``DataLoader`` of the per-worker batch; others pass."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if type(value).__module__.startswith("ray.data"):
        # Splitting between the workers must happen once, on the driver.
        raise CreatorTypeError(
            f"data_creator returned {_describe(value)}, a Ray Dataset: a worker cannot split it "
            f"with the others. Pass it to the trainer instead: TorchTrainer(..., datasets="
            f"{{'train': ds, 'val': val_ds}}) without a data_creator."
        )
    if not isinstance(value, Dataset) or isinstance(value, DataLoader):
        return value
    if isinstance(value, IterableDataset):
        raise CreatorTypeError(
            f"data_creator returned {_describe(value)}, an IterableDataset: polytrain cannot "
            f"give it a distributed sampler, so every worker would train on the same samples. "
            f"Return a DataLoader over it that yields this worker's share (shard by "
            f"torch.distributed.get_rank()), and pass add_dist_sampler=False."
        )
    batch_size = config.get("batch_size")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool):
        raise CreatorError(
            f"data_creator returned {_describe(value)}, a Dataset; polytrain batches it with "
            f"config['batch_size'] (the global batch), which is not set (got {batch_size!r}). "
            f"Set config['batch_size'], or return a DataLoader."
        )
    return DataLoader(value, batch_size=batch_size, shuffle=training)
