"""What every node's files must look like: the ``ModelLayout`` of a model's ``state_dict``
(which entries are exchanged, their shapes, tied weights) and its fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from speedtronic_callbacks.diloco.math import StateDict, is_synchronised, wire_shape


@dataclass(frozen=True)
class ModelLayout:
    """What every node's files must look like, derived from the model's ``state_dict``.

    ``sync_keys`` are the floating/complex entries exchanged in deltas (tied weights once:
    ``aliases`` maps each duplicate key to the key it shares storage with); ``carried_keys``
    are integer/boolean buffers that travel only in global files. ``fingerprint`` hashes the
    structure plus an optional config string, so nodes running another model or config
    reject each other's files instead of mixing them.
    """

    sync_keys: tuple[str, ...]
    carried_keys: tuple[str, ...]
    wire_shapes: Mapping[str, tuple[int, ...]]
    state_shapes: Mapping[str, tuple[int, ...]]
    aliases: Mapping[str, str]
    fingerprint: str
    key_order: tuple[str, ...] = ()
    """Every ``state_dict`` key in module order (what streaming fragments are cut from);
    not part of the fingerprint."""

    @property
    def sync_numel(self) -> int:
        """Elements in one delta (what a data-parallel gradient all-reduce would move)."""
        total = 0
        for key in self.sync_keys:
            count = 1
            for dim in self.wire_shapes[key]:
                count *= dim
            total += count
        return total


def _storage_identity(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def build_layout(state: StateDict, config_fingerprint: str = "") -> ModelLayout:
    """The ``ModelLayout`` of a live model state (call it on ``model.state_dict()`` so that
    tied weights are still recognisable by their shared storage)."""
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    sync: list[str] = []
    carried: list[str] = []
    for key in sorted(state):
        tensor = state[key]
        if tensor.numel() > 0:
            identity = _storage_identity(tensor)
            if identity in seen:
                aliases[key] = seen[identity]
                continue
            seen[identity] = key
        (sync if is_synchronised(tensor) else carried).append(key)
    wire = {key: wire_shape(state[key]) for key in sync}
    shapes = {key: tuple(state[key].shape) for key in state}
    digest = hashlib.sha256()
    for key in sorted(state):
        role = f"alias:{aliases[key]}" if key in aliases else ("sync" if key in wire else "carry")
        digest.update(f"{key}|{role}|{shapes[key]}\n".encode())
    digest.update(b"config:" + config_fingerprint.encode())
    return ModelLayout(
        sync_keys=tuple(sync),
        carried_keys=tuple(carried),
        wire_shapes=wire,
        state_shapes=shapes,
        aliases=aliases,
        fingerprint=digest.hexdigest()[:32],
        key_order=tuple(state),
    )
