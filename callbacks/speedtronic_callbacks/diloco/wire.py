"""The wire format: what DiLoCo nodes exchange, safetensors with signed metadata.

Three kinds of tensor file share one format (``signed_file``: ``FORMAT``, the signed
metadata, ``Rejected`` and its ``RejectionReason``):

* ``delta``  -- a node's pseudo-gradient in its codec (``delta_file``);
* ``global`` -- the master's full model state after an outer step (native dtypes; here);
* ``outer``  -- the master's outer-optimizer momentum plus its ``ledger`` (float32; here).

Decoding never trusts a file: ``decode_*`` either returns validated float tensors or
raises ``Rejected`` with a typed ``RejectionReason``; it never raises anything else on bad
input. This module re-exports the names of ``signed_file``, ``delta_file`` and ``ledger``
(the one place the hub files' codecs are imported from). The pointer that names the
current global files is in ``pointer``; what a model's files must contain
(``ModelLayout``) in ``model_layout``.
"""

from __future__ import annotations

import hmac
import json

import torch

from speedtronic_callbacks.diloco.delta_file import (
    MAX_BLOCK_SIZE,
    PACKED_KEYS,
    DecodedDelta,
    DeltaInfo,
    decode_delta,
    encode_delta,
    encode_wire,
    flatten_delta,
    fragment_layout,
    fragment_shapes,
    from_wire,
    to_wire,
    unflatten_delta,
    wire_encoding,
)
from speedtronic_callbacks.diloco.encoding import Compression
from speedtronic_callbacks.diloco.ledger import (
    MAX_INCARNATIONS,
    Covered,
    Ledger,
    Progress,
    covered_from_json,
    covered_through,
    covered_to_json,
    progress_from_json,
    progress_to_json,
)
from speedtronic_callbacks.diloco.math import StateDict
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.signed_file import (
    FORMAT,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    DecodedFile,
    Header,
    Rejected,
    RejectionReason,
    check_signature,
    decode_file,
    encode_file,
    json_nesting_depth,
    load_json,
    metadata_fields,
    parse_header,
    payload_sha256,
    require_fields,
    sign,
)

# The delta files (``delta_file``), the hub file format (``signed_file``), the ledger
# (``ledger``) and ``Compression`` (its earlier home) are re-exported.
__all__ = [
    "Compression",
    "Covered",
    "DecodedDelta",
    "DecodedFile",
    "DeltaInfo",
    "FORMAT",
    "Header",
    "Ledger",
    "MAX_BLOCK_SIZE",
    "MAX_HEADER_BYTES",
    "MAX_INCARNATIONS",
    "MAX_JSON_DEPTH",
    "PACKED_KEYS",
    "Progress",
    "Rejected",
    "RejectionReason",
    "check_signature",
    "covered_from_json",
    "covered_through",
    "covered_to_json",
    "decode_delta",
    "decode_file",
    "decode_global",
    "decode_outer",
    "encode_delta",
    "encode_file",
    "encode_global",
    "encode_outer",
    "encode_wire",
    "expand_aliases",
    "flatten_delta",
    "fragment_layout",
    "fragment_shapes",
    "from_wire",
    "global_tensors",
    "json_nesting_depth",
    "largest_file_bytes",
    "load_json",
    "metadata_fields",
    "parse_header",
    "payload_sha256",
    "progress_from_json",
    "progress_to_json",
    "require_fields",
    "sign",
    "to_wire",
    "unflatten_delta",
    "wire_encoding",
]


def global_tensors(state: StateDict, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """The entries a global file stores: synchronised and carried keys, aliases dropped."""
    return {key: state[key] for key in (*layout.sync_keys, *layout.carried_keys)}


def expand_aliases(state: StateDict, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """A full ``state_dict`` for ``load_state_dict``: each tied key points at its source."""
    full = dict(state)
    for alias, source in layout.aliases.items():
        full[alias] = state[source]
    return full


def encode_global(
    state: StateDict, outer_step: int, layout: ModelLayout, *, secret: bytes | None
) -> bytes:
    """The published global model after ``outer_step`` outer steps (native dtypes)."""
    return encode_file(
        "global",
        global_tensors(state, layout),
        {"outer_step": str(outer_step)},
        fingerprint=layout.fingerprint,
        secret=secret,
    )


def _check_expected_hash(decoded: DecodedFile, expected: str | None, what: str) -> None:
    if expected is not None and not hmac.compare_digest(decoded.sha256, expected):
        raise Rejected(RejectionReason.BAD_HASH, f"{what} is not the file the pointer names")


def decode_global(
    data: bytes,
    layout: ModelLayout,
    *,
    secret: bytes | None,
    outer_step: int | None = None,
    expected_sha256: str | None = None,
) -> dict[str, torch.Tensor]:
    """Validate a global file; ``outer_step`` and ``expected_sha256`` (from the pointer)
    must match it."""
    shapes = {key: layout.state_shapes[key] for key in (*layout.sync_keys, *layout.carried_keys)}
    decoded = decode_file(
        data,
        "global",
        fingerprint=layout.fingerprint,
        secret=secret,
        expected_shapes=shapes,
        allowed_dtypes=None,
        what="global model",
    )
    _check_expected_hash(decoded, expected_sha256, "global model")
    if outer_step is not None:
        found = decoded.fields.integer("outer_step", -1)
        if found != outer_step:
            raise Rejected(
                RejectionReason.BAD_METADATA,
                f"global model is outer step {found}, the pointer says {outer_step}",
            )
    return decoded.tensors


def encode_outer(
    momentum: StateDict,
    ledger: Ledger,
    outer_step: int,
    layout: ModelLayout,
    *,
    secret: bytes | None,
) -> bytes:
    """The master's outer state (momentum + ledger) after ``outer_step`` outer steps."""
    tensors = {key: momentum[key] for key in sorted(momentum)}
    fields = {"outer_step": str(outer_step), "ledger": ledger.to_json()}
    return encode_file("outer", tensors, fields, fingerprint=layout.fingerprint, secret=secret)


def decode_outer(
    data: bytes,
    layout: ModelLayout,
    *,
    secret: bytes | None,
    outer_step: int,
    expected_sha256: str | None = None,
) -> tuple[dict[str, torch.Tensor], Ledger]:
    """Validate an outer-state file; momentum keys must be a subset of the delta keys."""
    decoded = decode_file(
        data,
        "outer",
        fingerprint=layout.fingerprint,
        secret=secret,
        expected_shapes=None,
        allowed_dtypes={"F32": torch.float32},
        what="outer state",
    )
    _check_expected_hash(decoded, expected_sha256, "outer state")
    for key, tensor in decoded.tensors.items():
        if layout.wire_shapes.get(key) != tuple(tensor.shape):
            raise Rejected(RejectionReason.WRONG_KEYS, f"outer state has stray key {key!r}")
    if decoded.fields.integer("outer_step", -1) != outer_step:
        raise Rejected(RejectionReason.BAD_METADATA, "outer state is for another outer step")
    require_fields(decoded.metadata, ("ledger",), "outer state")
    try:
        ledger = Ledger.from_json(decoded.metadata["ledger"])
    except (ValueError, json.JSONDecodeError) as exc:
        raise Rejected(RejectionReason.BAD_METADATA, f"outer state ledger: {exc}") from None
    return decoded.tensors, ledger


def largest_file_bytes(layout: ModelLayout) -> int:
    """An upper bound on the size of any honest hub file of this model: every stored entry
    at 8 bytes per element plus the largest header. Reads of larger files are refused from
    their size alone (``Transport.limit_file_size``), so a huge or sparse file planted on
    the hub is never loaded into memory."""
    elements = 0
    for key in (*layout.sync_keys, *layout.carried_keys):
        count = 1
        for dim in layout.state_shapes[key]:
            count *= dim
        elements += count
    return 8 + MAX_HEADER_BYTES + 8 * elements
