"""Sharded training state: what each worker holds, as ranges of the consolidated state (worker side).

The consolidated state of a torch strategy (``{"models": [state_dict, ...],
"optimizers": [torch optimizer state_dict, ...]}``, see
:meth:`~polytrain.backends.core.strategy.Strategy.full_state_dict`) is a tree whose
big leaves are tensors. A sharded checkpoint stores each tensor leaf flattened
(row-major) and cut into contiguous ranges, one :class:`Piece` per range; the
rest of the tree (hyperparameters, scalars) is the *skeleton*. Every sharding
scheme polytrain supports holds contiguous ranges of flattened tensors: FSDP's
sharded views, ZeRO's fp32 partitions and fragments, OSS's whole per-parameter
states. So a checkpoint written by any backend at any world size is read back
by any other: each rank reads exactly the ranges it holds through a
:class:`ShardReader`, and a replicated backend reads whole tensors.

Leaves are addressed by a :data:`StatePath` into the consolidated tree, e.g.
``("models", 0, "fc.weight")`` or ``("optimizers", 0, "state", 3, "exp_avg")``.
This module is the contract between the strategies (which say what they hold
and load what they are given) and the checkpoint files (``trainer_api``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

#: The address of one tensor leaf in the consolidated state.
StatePath = tuple[Any, ...]
#: The consolidated state's entry that lists, per model, the frozen parameters it leaves
#: out: ``[{"names": [...], "base": ...} or None, ...]`` (see :func:`left_out`).
FROZEN_KEY = "frozen"


@dataclass
class Piece:
    """One rank's contiguous range of one tensor of the consolidated state.

    Attributes:
        path: the tensor's address in the consolidated state.
        shape: the full tensor's shape.
        tensor: the values of flattened elements ``[start, start + numel)``: a 1-D tensor
            (a view where the strategy can, on any device), or a 1-D numpy array.
        start: the offset of the range in the flattened full tensor.
        replicated: every rank holds the same full tensor (a checkpoint writer picks one
            rank to write it); False when this rank is the only one holding this range.
    """

    path: StatePath
    shape: tuple[int, ...]
    tensor: torch.Tensor
    start: int = 0
    replicated: bool = False

    @property
    def numel(self) -> int:
        """The number of elements of the range."""
        return _numel_of(self.tensor)


def _numel_of(array: Any) -> int:
    numel = array.numel if callable(getattr(array, "numel", None)) else None
    return int(numel()) if numel is not None else int(array.size)


def nbytes(array: Any) -> int:
    """The bytes of a torch tensor or a numpy array."""
    if callable(getattr(array, "element_size", None)):
        return int(array.numel()) * int(array.element_size())
    return int(array.nbytes)


@dataclass
class LocalState:
    """What one rank contributes to a sharded checkpoint.

    Attributes:
        pieces: the tensor ranges this rank holds.
        skeleton: rank 0 only (None elsewhere): the consolidated ``{"models", "optimizers"}``
            tree with its tensor leaves left out.
    """

    pieces: list[Piece]
    skeleton: dict[str, Any] | None


class ShardReader(Protocol):
    """Reads ranges of a checkpoint's tensors (the checkpoint side implements it)."""

    @property
    def skeleton(self) -> dict[str, Any]:
        """The consolidated ``{"models", "optimizers"}`` tree without its tensor leaves."""

    def shape(self, path: StatePath) -> tuple[int, ...] | None:
        """The full shape of the tensor at ``path``; None when the checkpoint has none there."""

    def paths(self) -> list[StatePath]:
        """Every tensor path in the checkpoint."""

    def read(self, path: StatePath, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Flattened elements ``[start, start + numel)`` (default: all) of the tensor at ``path``, 1-D."""


# ------------------------------------------------------------------ split
def split_state(state: dict[str, Any], replicated: bool, with_skeleton: bool = True) -> LocalState:
    """Cut a consolidated ``{"models", "optimizers"}`` state into whole-tensor pieces and a skeleton.

    Args:
        state: the consolidated state (models' state dicts, torch-format optimizer states).
        replicated: whether every rank holds this same state.
        with_skeleton: keep the skeleton (rank 0) or drop it.
    """
    pieces: list[Piece] = []

    def strip(node: Any, path: StatePath) -> Any:
        if _is_tensor(node):
            pieces.append(whole_piece(path, node, replicated))
            return None
        if isinstance(node, dict):
            kept = {}
            for key, value in node.items():
                stripped = strip(value, (*path, key))
                if stripped is not None or not _is_tensor(value):
                    kept[key] = stripped
            return kept
        if isinstance(node, (list, tuple)) and path[:1] in (("models",), ("optimizers",)):
            if len(path) <= 2 or _has_tensor(node):
                return [strip(value, (*path, i)) for i, value in enumerate(node)]
        return copy.deepcopy(node)

    skeleton = {key: strip(state.get(key) or [], (key,)) for key in ("models", "optimizers")}
    return LocalState(pieces=pieces, skeleton=skeleton if with_skeleton else None)


def whole_piece(path: StatePath, tensor: torch.Tensor, replicated: bool) -> Piece:
    """A :class:`Piece` holding all of ``tensor``."""
    tensor = tensor.detach()
    return Piece(
        path=path, shape=tuple(tensor.shape), tensor=tensor.reshape(-1), replicated=replicated
    )


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "reshape") and hasattr(value, "dtype")


def _has_tensor(node: Any) -> bool:
    if _is_tensor(node):
        return True
    if isinstance(node, dict):
        return any(_has_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_tensor(v) for v in node)
    return False


# --------------------------------------------------------------- assemble
def assemble(skeleton: dict[str, Any], reader: ShardReader, paths: Iterable[StatePath]) -> dict:
    """The consolidated state: ``skeleton`` with every tensor at ``paths`` read whole and reshaped.

    Returns a new tree; ``skeleton`` is not modified.
    """
    tree = copy.deepcopy(skeleton)
    for path in paths:
        shape = reader.shape(path)
        _set_leaf(tree, path, reader.read(path).reshape(shape))
    return tree


def _set_leaf(tree: Any, path: StatePath, value: Any) -> None:
    node = tree
    for i, key in enumerate(path[:-1]):
        nxt = node[key] if _contains(node, key) else None
        if nxt is None:
            nxt = [] if isinstance(path[i + 1], int) and path[0] != "optimizers" else {}
            _put(node, key, nxt)
        node = nxt
    _put(node, path[-1], value)


def _contains(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(key, int) and key < len(node)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, dict):
        node[key] = value
        return
    while len(node) <= key:
        node.append(None)
    node[key] = value


def optimizer_pieces(index: int, state: dict[str, Any] | None, replicated: bool) -> list[Piece]:
    """Whole-tensor pieces of optimizer ``index``'s torch-format ``state``."""
    pieces = []
    for param_index, entry in ((state or {}).get("state") or {}).items():
        for key, value in entry.items():
            if _is_tensor(value):
                path = ("optimizers", index, "state", param_index, key)
                pieces.append(whole_piece(path, value, replicated))
    return pieces


def model_pieces(index: int, state: dict[str, Any], replicated: bool) -> list[Piece]:
    """Whole-tensor pieces of model ``index``'s ``state`` (its state dict)."""
    return [
        whole_piece(("models", index, key), value, replicated)
        for key, value in state.items()
        if _is_tensor(value)
    ]


def persistent_buffers(model: Any, rename: Any = None) -> list[tuple[str, Any]]:
    """``(state_dict key, buffer)`` for the buffers ``model.state_dict()`` would hold.

    ``rename`` maps each name (e.g. to drop a wrapper's prefix).
    """
    found = []
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            found.append((rename(full) if rename else full, buffer))
    return found


def whole_model_state(reader: ShardReader, index: int) -> dict[str, Any]:
    """Model ``index``'s whole state dict from the checkpoint (every tensor read in full)."""
    models = reader.skeleton.get("models") or []
    state = dict(models[index] or {}) if index < len(models) else {}
    for path in reader.paths():
        if path[:2] == ("models", index) and len(path) == 3:
            state[path[2]] = reader.read(path).reshape(reader.shape(path))
    return state


def left_out(skeleton: dict[str, Any], index: int) -> frozenset[str]:
    """The frozen parameters of model ``index`` that a checkpoint left out (kept as they are on load).

    A run with frozen parameters (a LoRA fine-tune's base) saves only what it trains;
    ``skeleton`` is a reader's skeleton or a consolidated state.
    """
    entries = skeleton.get(FROZEN_KEY) or []
    entry = entries[index] if index < len(entries) else None
    return frozenset((entry or {}).get("names") or ())


def with_left_out(state: dict[str, Any], module: Any, names: Iterable[str]) -> dict[str, Any]:
    """``state`` with the left-out tensors ``names`` taken from ``module`` (held whole) as they are."""
    missing = [name for name in names if name not in state]
    if not missing:
        return state
    live = module.state_dict()
    return {**state, **{name: live[name] for name in missing if name in live}}


def load_whole_model(module: Any, reader: ShardReader, index: int) -> None:
    """Load model ``index`` whole into ``module``; frozen tensors the checkpoint left out stay."""
    state = whole_model_state(reader, index)
    module.load_state_dict(with_left_out(state, module, left_out(reader.skeleton, index)))


class StateReader:
    """A :class:`ShardReader` over a consolidated state held in memory (a checkpoint file's).

    Args:
        state: ``{"models": [...], "optimizers": [...], ...}`` as ``trainer.save`` writes it.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        local = split_state(state, replicated=False)
        self._skeleton = {**(local.skeleton or {}), FROZEN_KEY: state.get(FROZEN_KEY)}
        self._pieces = {piece.path: piece for piece in local.pieces}

    @property
    def skeleton(self) -> dict[str, Any]:
        """The consolidated tree without its tensor leaves (and the frozen entry)."""
        return self._skeleton

    def paths(self) -> list[StatePath]:
        """Every tensor path."""
        return list(self._pieces)

    def shape(self, path: StatePath) -> tuple[int, ...] | None:
        """The full shape of the tensor at ``path`` (None: no tensor there)."""
        piece = self._pieces.get(tuple(path))
        return None if piece is None else piece.shape

    def read(self, path: StatePath, start: int = 0, numel: int | None = None) -> Any:
        """Flattened elements ``[start, start + numel)`` of the tensor at ``path``, 1-D."""
        flat = self._pieces[tuple(path)].tensor
        end = flat.numel() if numel is None else start + numel
        return flat[start:end]


def optimizer_skeleton(
    param_groups: list[dict[str, Any]], scalars: dict[int, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The skeleton of a torch-format optimizer state: groups with index lists, non-tensor state."""
    groups, index = [], 0
    for group in param_groups:
        entry = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        entry["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(entry)
    return {"state": copy.deepcopy(scalars or {}), "param_groups": groups}


def local_optimizer_state(
    reader: ShardReader,
    optimizer_index: int,
    ranges: dict[int, tuple[int, int] | None],
) -> dict[str, Any] | None:
    """A torch-format optimizer state holding this rank's ranges, to ``load_state_dict``.

    Args:
        reader: the checkpoint.
        optimizer_index: which optimizer of the checkpoint.
        ranges: ``param index -> (start, numel)`` of the flattened parameter this rank
            holds (None: the whole tensor); indices left out get no state. Per-parameter
            tensors shaped like their parameter are read at that range; other tensors
            (such as a 0-dim ``step``) are read whole.

    Returns:
        The state, or None when the checkpoint has no state for this optimizer.
    """
    skeleton_opts = reader.skeleton.get("optimizers") or []
    if optimizer_index >= len(skeleton_opts) or skeleton_opts[optimizer_index] is None:
        return None
    skeleton = copy.deepcopy(skeleton_opts[optimizer_index])
    by_param: dict[int, list[StatePath]] = {}
    for path in reader.paths():
        if path[:3] == ("optimizers", optimizer_index, "state") and len(path) == 5:
            by_param.setdefault(int(path[3]), []).append(path)
    state: dict[int, dict[str, Any]] = {}
    for index, scalars in (skeleton.get("state") or {}).items():
        if int(index) in ranges:
            state[int(index)] = dict(scalars)
    for index, paths in by_param.items():
        if index not in ranges:
            continue
        entry = state.setdefault(index, {})
        rng = ranges[index]
        full_numel = max((_numel(reader.shape(p)) for p in paths), default=0)
        for path in paths:
            shape = reader.shape(path)
            if rng is not None and _numel(shape) == full_numel and len(shape) > 0:
                entry[path[4]] = reader.read(path, rng[0], rng[1])
            else:
                entry[path[4]] = reader.read(path).reshape(shape)
    skeleton["state"] = state
    return skeleton


def _numel(shape: tuple[int, ...] | None) -> int:
    total = 1
    for dim in shape or ():
        total *= int(dim)
    return total
