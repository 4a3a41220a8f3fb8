"""The files of a hub and the master state a published version holds.

::

    global/step_count.json                 the pointer (``pointer``): the current version
    global/model_00000012.safetensors      version 12's global model       } one published
    global/outer_00000012.safetensors      version 12's momentum + ledger  } version
    nodes/<node id>/delta_<step>_<hash16>.safetensors    a node's pseudo-gradient

A version is ``OuterState``: the global model, the outer momentum, the outer step and the
ledger; the master publishes one per round (``wire.encode_global``/``encode_outer``, then
the pointer), recovers one at start-up (``recovery``) and deletes old ones
(``hub_gc``). Every name is parsed strictly: anything else under ``nodes/`` or ``global/`` is
not a hub file and is never read as one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from speedtronic_callbacks.diloco.fields import MAX_STEP, NODE_ID_PATTERN
from speedtronic_callbacks.diloco.math import StateDict
from speedtronic_callbacks.diloco.pointer import MODEL_FILE_PATTERN, OUTER_FILE_PATTERN
from speedtronic_callbacks.diloco.wire import Ledger

__all__ = [
    "DELTA_PATH_PATTERN",
    "DeltaName",
    "OuterState",
    "clone_state",
    "delta_path",
    "global_file_step",
    "parse_delta_path",
]

DELTA_PATH_PATTERN = re.compile(
    r"^nodes/(?P<node>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})/"
    r"delta_(?P<step>\d+)_(?P<hash>[0-9a-f]{16})\.safetensors$"
)


@dataclass(frozen=True)
class DeltaName:
    """What a delta's path claims (checked against its signed header once downloaded)."""

    node_id: str
    local_step: int
    hash_prefix: str


def delta_path(node_id: str, local_step: int, sha256: str) -> str:
    """``nodes/<node>/delta_<step>_<hash16>.safetensors``: the content hash in the name
    makes a re-upload of the same delta land on the same path (idempotent), and a
    different delta for the same step land next to it instead of overwriting it."""
    if not NODE_ID_PATTERN.match(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"nodes/{node_id}/delta_{local_step}_{sha256[:16]}.safetensors"


def parse_delta_path(path: str) -> DeltaName | None:
    """The parts of a well-formed delta path, or ``None`` for anything else."""
    match = DELTA_PATH_PATTERN.match(path)
    if match is None:
        return None
    return DeltaName(match["node"], int(match["step"]), match["hash"])


def global_file_step(path: str) -> int | None:
    """The outer step of a global file's name (``None``: not one, or beyond ``MAX_STEP``,
    which no valid pointer or file header can name)."""
    match = MODEL_FILE_PATTERN.match(path) or OUTER_FILE_PATTERN.match(path)
    step = int(match.group(1)) if match else None
    return step if step is not None and step <= MAX_STEP else None


def clone_state(state: StateDict) -> dict[str, torch.Tensor]:
    return {key: value.detach().to("cpu").clone() for key, value in state.items()}


@dataclass
class OuterState:
    """The master's state. Tensors are never modified in place once committed (a round
    builds new ones), so a snapshot can share them safely."""

    global_state: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    outer_step: int
    ledger: Ledger = field(default_factory=Ledger)
