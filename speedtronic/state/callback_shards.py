"""Sharded tensors in callback state: a callback's ``DTensor`` shards travel through DCP.

Under ``parallel.strategy: fsdp`` a callback may keep tensors that are sharded like the
model's parameters -- ``DTensor`` values holding this rank's shard, such as the ``ema``
callback's shadow weights -- and return them from ``state_dict()``. A sharded checkpoint's
``state.pt`` is written by rank 0 alone and holds plain tensors only, so these leaves go
into the DCP part of the checkpoint beside the model and the optimizer instead, each rank
writing its own shard::

    state.pt         callbacks: {"ema": {"weights": {}, "live": True}}   the leaves taken out
                     callback_shard_paths: [["ema", "weights", "head.weight"], ...]
    __0_0.distcp     callback_shards.0, callback_shards.1, ...           rank 0's shards
    __1_0.distcp                                                          rank 1's shards

On resume (``with_callback_shards``) every leaf is loaded back -- DCP reshards, so the
checkpoint may have been written by another number of ranks -- into a ``DTensor`` laid out
as the resuming model's parameters are (FSDP's dim-0 shards over its mesh; a 0-d tensor
replicated), or, when the model is not sharded (one process, ``speedtronic export``), into
a whole plain tensor on the CPU. The callback's ``load_state_dict`` then gets its state
back in one piece. Sharded leaves must sit in dicts with string keys (not in lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import torch
from torch import nn

from speedtronic.state.errors import CheckpointError, CorruptCheckpointError
from speedtronic.state.sharded_checkpoint import (
    CALLBACK_SHARDS,
    SHARDED_DIRECTORY,
    load_tensor_entries,
    saved_tensor_entries,
)

__all__ = ["CALLBACK_SHARD_PATHS", "split_callback_shards", "with_callback_shards"]

CALLBACK_SHARD_PATHS = "callback_shard_paths"
"""The ``state.pt`` entry listing where each sharded leaf sat in the callback states: entry
``i`` is ``[state_key, key, ...]`` of the DCP tensor ``callback_shards.<i>``."""

_CallbackStates = dict[str, dict[str, object]]
_ShardPath = tuple[str, ...]
_KeyPath = tuple[object, ...]


def _is_dtensor(value: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _take_shards(
    tree: Mapping[object, object], path: _KeyPath, found: list[tuple[_ShardPath, torch.Tensor]]
) -> dict[object, object]:
    """``tree`` without its ``DTensor`` leaves, which are appended to ``found``.
    ``CheckpointError`` for a leaf in a list or below a key that is not a string."""
    kept: dict[object, object] = {}
    for key, value in tree.items():
        where = (*path, key)
        if _is_dtensor(value):
            if not all(isinstance(part, str) for part in where):
                raise CheckpointError(
                    f"cannot checkpoint callback state {_describe(where)}: a sharded tensor "
                    "(DTensor) must sit in dicts with string keys"
                )
            assert isinstance(value, torch.Tensor)
            found.append((cast(_ShardPath, where), value))
        elif isinstance(value, Mapping):
            kept[key] = _take_shards(value, where, found)
        elif isinstance(value, (list, tuple)) and any(_is_dtensor(item) for item in value):
            raise CheckpointError(
                f"cannot checkpoint callback state {_describe(where)}: it is a list holding "
                "sharded tensors (DTensor); keep them in a dict with string keys"
            )
        else:
            kept[key] = value
    return kept


def _describe(path: _KeyPath) -> str:
    return "state['callbacks']" + "".join(f"[{key!r}]" for key in path)


def split_callback_shards(
    states: Mapping[str, Mapping[str, object]],
) -> tuple[_CallbackStates, dict[str, torch.Tensor], list[list[str]]]:
    """``states`` (``Trainer.callback_states()``) without their ``DTensor`` leaves; the
    leaves by DCP key (``"0"``, ``"1"``, ...); and where each sat (``CALLBACK_SHARD_PATHS``).
    ``CheckpointError`` for a sharded leaf inside a list."""
    found: list[tuple[_ShardPath, torch.Tensor]] = []
    plain = {
        key: cast(
            dict[str, object],
            _take_shards(cast(Mapping[object, object], state), (key,), found),
        )
        for key, state in states.items()
    }
    shards = {str(index): tensor for index, (_, tensor) in enumerate(found)}
    return plain, shards, [list(path) for path, _ in found]


def _shard_paths(value: object) -> list[_ShardPath]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(path, list) and len(path) >= 2 and all(isinstance(k, str) for k in path)
        for path in value
    ):
        raise CorruptCheckpointError(
            f"the checkpoint's {CALLBACK_SHARD_PATHS} is not a list of key paths"
        )
    return [tuple(cast(list[str], path)) for path in value]


def _layout_of(model: nn.Module | None) -> tuple[object, tuple[object, ...]] | None:
    """The device mesh and placements of the model's sharded parameters (``None``: the
    model is not sharded)."""
    if model is None:
        return None
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            return parameter.device_mesh, tuple(parameter.placements)
    return None


def _template(size: Sequence[int], dtype: torch.dtype, layout: object) -> torch.Tensor:
    """An empty tensor to load a saved leaf into: laid out like the model's parameters, or
    whole on the CPU."""
    if layout is None:
        return torch.empty(tuple(size), dtype=dtype)
    from torch.distributed.tensor import Replicate, empty

    mesh, placements = cast("tuple[object, tuple[object, ...]]", layout)
    if not size:  # a 0-d tensor cannot be split: every rank holds it
        placements = tuple(Replicate() for _ in placements)
    return empty(*size, dtype=dtype, device_mesh=mesh, placements=placements)  # type: ignore[arg-type]  # mesh and placements of the model's own DTensor


def _insert(states: _CallbackStates, path: _ShardPath, tensor: torch.Tensor) -> None:
    node = cast(dict[str, object], states)
    for key in path[:-1]:
        child = node.get(key, {})
        if not isinstance(child, Mapping):
            raise CorruptCheckpointError(
                f"the checkpoint's sharded callback tensor {_describe(path)} has no place: "
                f"{key!r} is not a mapping"
            )
        # A copy on the way down: the loaded state's own dicts stay as they were read.
        copied = dict(cast(Mapping[str, object], child))
        node[key] = copied
        node = copied
    node[path[-1]] = tensor


def with_callback_shards(
    state: Mapping[str, object], like: nn.Module | None = None
) -> _CallbackStates:
    """The callback states of a loaded training state, whole: for a sharded checkpoint
    written by several ranks the ``DTensor`` leaves are loaded from its directory (on every
    rank of a distributed job: a collective) and put back where they were -- as ``DTensor``
    laid out like ``like``'s parameters when it is sharded, else as whole CPU tensors.
    Any other state's callback states are returned as they are."""
    callbacks = state.get("callbacks")
    states: _CallbackStates = {
        str(key): dict(value)
        for key, value in (callbacks.items() if isinstance(callbacks, Mapping) else ())
        if isinstance(value, Mapping)
    }
    paths = _shard_paths(state.get(CALLBACK_SHARD_PATHS))
    directory = state.get(SHARDED_DIRECTORY)
    if not paths or not isinstance(directory, str):
        return states
    layout = _layout_of(like)
    saved = saved_tensor_entries(Path(directory), CALLBACK_SHARDS)
    templates: dict[str, torch.Tensor] = {}
    for index, path in enumerate(paths):
        entry = saved.get(str(index))
        if entry is None:
            raise CorruptCheckpointError(
                f"sharded checkpoint {directory} lists callback tensor {_describe(path)} "
                f"({CALLBACK_SHARDS}.{index}), which its shards do not hold"
            )
        templates[str(index)] = _template(entry[0], entry[1], layout)
    loaded = load_tensor_entries(Path(directory), CALLBACK_SHARDS, templates)
    for index, path in enumerate(paths):
        _insert(states, path, loaded[str(index)])
    return states
