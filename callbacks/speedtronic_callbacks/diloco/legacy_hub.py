"""Reading a hub that speedtronic 2.0 wrote, so that a master can continue it.

2.0's layout (see ``docs/distributed.md``, "Continuing a 2.0 hub")::

    global/step_count.json       {"outer_step": N, "updated_at": ..., "model_file": ..., ...}
    global/latest.safetensors    the full model state dict, native dtypes, no metadata
    nodes/<node>/delta_<step>.safetensors   2.0 deltas (never applied by this version)

The pointer is unsigned JSON with integer (or, in older files, ``step``) versions, and the
model file carries no fingerprint or hash, so it is checked the only way possible: it must
be a well-formed safetensors file (header checked before loading, as for any hub file)
holding exactly this model's keys with this model's shapes and finite values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import safetensors.torch
import torch

from speedtronic_callbacks.diloco.fields import FieldError, check_integer
from speedtronic_callbacks.diloco.math import is_synchronised
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.wire import (
    Rejected,
    RejectionReason,
    global_tensors,
    load_json,
    metadata_fields,
    parse_header,
)

__all__ = ["V2_MODEL_FILE", "V2Pointer", "decode_v2_global", "is_v2_delta", "read_v2_pointer"]

V2_MODEL_FILE = "global/latest.safetensors"
_V2_MODEL_PATTERN = re.compile(r"^global/[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")
_V2_DELTA_PATTERN = re.compile(r"^nodes/[^/]+/delta_\d+\.safetensors$")


@dataclass(frozen=True)
class V2Pointer:
    """2.0's ``global/step_count.json``: the outer step and the file of the global model."""

    outer_step: int
    model_file: str = V2_MODEL_FILE
    updated_at: str = ""


def read_v2_pointer(raw: bytes) -> V2Pointer | None:
    """The 2.0 pointer in ``raw``, or ``None`` when it is not one (this version's pointers
    carry a ``format`` field). A 2.0-looking pointer with a bad step or a model file outside
    ``global/`` is ``Rejected``."""
    try:
        value = load_json(raw, "pointer")
    except Rejected:
        return None
    if not isinstance(value, dict) or "format" in value:
        return None
    step = value.get("outer_step", value.get("step"))
    try:  # bounded like this version's field: no 5,000-digit or superscript "steps"
        if isinstance(step, str):
            step = metadata_fields({"outer_step": step.strip()}, "2.0 pointer").integer(
                "outer_step"
            )
        step = check_integer(step, "outer_step")
    except (Rejected, FieldError):
        raise Rejected(
            RejectionReason.BAD_METADATA, f"2.0 pointer has outer step {step!r:.40}"
        ) from None
    model_file = value.get("model_file", V2_MODEL_FILE)
    if not isinstance(model_file, str) or not _V2_MODEL_PATTERN.match(model_file):
        raise Rejected(RejectionReason.BAD_METADATA, f"2.0 pointer names {model_file!r}")
    updated_at = value.get("updated_at", "")
    return V2Pointer(step, model_file, updated_at if isinstance(updated_at, str) else "")


def decode_v2_global(data: bytes, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """The global state of a 2.0 model file (aliases of tied weights dropped), after
    checking that it holds exactly this model's keys and shapes with finite values."""
    header = parse_header(data)  # sizes and offsets checked before anything is loaded
    expected = dict(layout.state_shapes)
    found = {key: shape for key, (_, shape) in header.entries.items()}
    if set(found) != set(expected):
        missing = sorted(set(expected) - set(found))[:5]
        extra = sorted(set(found) - set(expected))[:5]
        raise Rejected(
            RejectionReason.WRONG_KEYS,
            f"2.0 global model is another model (missing {missing}, unexpected {extra})",
        )
    wrong = sorted(key for key in expected if tuple(found[key]) != tuple(expected[key]))
    if wrong:
        raise Rejected(RejectionReason.WRONG_SHAPES, f"2.0 global model has other shapes: {wrong}")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # the library raises several types for damaged payloads
        raise Rejected(RejectionReason.CORRUPT, f"2.0 global model unreadable: {exc}") from None
    for key, tensor in tensors.items():
        if is_synchronised(tensor) and not bool(torch.isfinite(tensor).all()):
            raise Rejected(RejectionReason.NON_FINITE, f"2.0 global model has NaN/Inf in {key!r}")
    return global_tensors(tensors, layout)


def is_v2_delta(path: str) -> bool:
    """Whether ``path`` is a 2.0 delta file (``nodes/<node>/delta_<step>.safetensors``)."""
    return _V2_DELTA_PATTERN.match(path) is not None
