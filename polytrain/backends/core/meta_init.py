"""Building models without a full copy on every worker: rank 0 builds them, the others on ``meta``.

The sharded backends (fsdp, DeepSpeed ZeRO-3) call ``model_creator`` for real on
rank 0 only; the other ranks build the same modules on the meta device (shapes, no
storage) and receive their shards of rank 0's weights after sharding (torchtitan's,
Accelerate's ``cpu_ram_efficient_loading`` and Lightning's ``empty_init`` recipe).
What a creator does on a non-zero rank is discarded: its initialisation, its
random numbers, any weights it loads. These helpers know no backend; each backend
decides when to use them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from polytrain.backends.core.context import WorkerContext
from polytrain.errors import CreatorError

T = TypeVar("T")

#: Tied parameters as ``[(module path, attribute), ...]`` groups of one parameter object.
TieGroups = list[list[tuple[str, str]]]


def build_on_meta(create: Callable[[], T], ctx: WorkerContext, how_to_disable: str) -> T:
    """Worker: call ``create`` (``model_creator``) under ``torch.device("meta")``.

    ``transformers``' ``from_pretrained``, which refuses the meta device, builds the
    model's structure there without reading a file (rank 0's weights replace it).

    Args:
        create: calls the user's ``model_creator``.
        ctx: this worker's context (its rank is named in the error).
        how_to_disable: the option that turns rank-0 initialisation off, as the user writes it.

    Raises:
        CreatorError: the creator failed on the meta device (it reads parameter values,
            calls ``.item()``, builds tensors it cannot build without storage...).
    """
    from polytrain.hf.loading import building

    try:
        # building: polytrain.hf's and transformers' from_pretrained build the structure only.
        with torch.device("meta"), building("meta"):
            return create()
    except Exception as exc:
        raise meta_error(exc, ctx, "on the meta device", how_to_disable) from exc


def meta_error(exc: Exception, ctx: WorkerContext, where: str, how_to_disable: str) -> CreatorError:
    """The error of a ``model_creator`` that cannot build its model without storage."""
    return CreatorError(
        f"model_creator failed on rank {ctx.world_rank}, which builds the model {where} so that "
        f"only rank 0 holds the full weights: {type(exc).__name__}: {exc}. A creator that only "
        f"builds modules works there; one that reads parameter values (.item(), comparisons, "
        f"numpy) or loads weights into tensors it created itself does not. Move such code out of "
        f"model_creator, or set {how_to_disable} to build the full model on every worker."
    )


def on_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no storage)."""
    return any(t.device.type == "meta" for t in _tensors(module))


def tie_groups(model: torch.nn.Module) -> TieGroups:
    """The places that share one parameter object (e.g. GPT-2's ``wte`` and ``lm_head``)."""
    places: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((path, attr))
    return [group for group in places.values() if len(group) > 1]


def retie(model: torch.nn.Module, groups: TieGroups) -> None:
    """Make every group of :func:`tie_groups` one parameter object again (the first place's).

    ``to_empty`` on plain modules allocates each place anew, which silently unties
    weights that must stay shared; parameters already shared are left alone.
    """
    for (first_path, first_attr), *rest in groups:
        param = model.get_submodule(first_path)._parameters[first_attr]
        for path, attr in rest:
            module = model.get_submodule(path)
            if module._parameters[attr] is not param:
                module._parameters[attr] = param


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Worker: storage (uninitialised) for every meta tensor of ``model``, ties kept."""
    if not on_meta(model):
        return
    groups = tie_groups(model)
    model.to_empty(device=device)
    retie(model, groups)


def broadcast_from_rank0(tensors: Sequence[torch.Tensor]) -> None:
    """Worker (every rank, collective): rank 0's values of ``tensors`` on every rank."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def load_whole_from_rank0(model: torch.nn.Module, device: torch.device) -> None:
    """Worker (every rank, collective): an unsharded ``model`` built on meta gets rank 0's weights.

    For the models a backend does not shard (frozen ones): every rank holds them whole,
    as without rank-0 initialisation.
    """
    materialize(model, device)
    model.to(device)
    broadcast_from_rank0([*model.parameters(), *model.buffers()])


def meta_param_init_fn(device: torch.device) -> Callable[[torch.nn.Module], None]:
    """FSDP1's ``param_init_fn``: storage for one module's own meta tensors, ties kept.

    FSDP1 calls it module by module (not recursively); a parameter shared by two
    modules gets one new parameter, so tied weights stay tied.
    """
    made: dict[int, torch.nn.Parameter] = {}

    def init(module: torch.nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                if id(param) not in made:
                    empty = torch.empty_like(param, device=device)
                    made[id(param)] = torch.nn.Parameter(empty, param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty_like(buffer, device=device)

    return init


def _tensors(module: torch.nn.Module) -> Iterator[Any]:
    yield from module.parameters()
    yield from module.buffers()
