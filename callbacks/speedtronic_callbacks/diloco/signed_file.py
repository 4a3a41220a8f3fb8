"""A hub file: safetensors with signed metadata, parsed and checked without trust.

Every hub file (``wire``: deltas, the global model, the outer state) carries, as
safetensors header metadata (all strings): the format (``FORMAT``), its kind, a model/config
fingerprint, the element count, the sha256 of the tensor payload and, when a shared secret
is configured, an HMAC-SHA256 signature over all other metadata fields (which includes the
payload hash, so the signature covers the tensors too). ``decode_file`` either returns a
validated file or raises ``Rejected`` with a typed ``RejectionReason``; the header's
length, JSON nesting and tensor sizes are checked before anything is loaded.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import safetensors.torch
import torch

from speedtronic_callbacks.diloco.fields import FieldError, Fields, parse_fields
from speedtronic_callbacks.diloco.math import StateDict, is_synchronised

FORMAT = "speedtronic-diloco/1"
"""The value of the ``format`` metadata field; other formats are rejected."""

MAX_HEADER_BYTES = 64 * 1024 * 1024
"""Refuse safetensors headers larger than this (a hostile file could claim gigabytes)."""

MAX_JSON_DEPTH = 8
"""The deepest JSON nesting accepted anywhere in a hub file (real files nest 3 deep).
Checked before parsing, so a 100,000-deep header is a rejection, not a RecursionError."""


class RejectionReason(str, enum.Enum):
    """Why a file from another node was not used. Every bad input maps to one of these."""

    CORRUPT = "corrupt"
    BAD_METADATA = "bad_metadata"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    FOREIGN_FINGERPRINT = "foreign_fingerprint"
    WRONG_KEYS = "wrong_keys"
    WRONG_SHAPES = "wrong_shapes"
    WRONG_DTYPE = "wrong_dtype"
    ELEMENT_COUNT = "element_count"
    BAD_HASH = "bad_hash"
    NON_FINITE = "non_finite"
    NAME_MISMATCH = "name_mismatch"
    UNSAFE_FILE = "unsafe_file"
    TOO_LARGE = "too_large"
    TOO_STALE = "too_stale"
    FUTURE_BASE = "future_base"
    UNKNOWN_ENCODING = "unknown_encoding"
    BAD_PACKING = "bad_packing"
    OUTLIER = "outlier"
    OVERLAP = "overlap"


class Rejected(Exception):
    """A file failed validation; ``reason`` is machine-readable, ``detail`` is for people."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


# -- hashing and signing ---------------------------------------------------------------


def payload_sha256(tensors: StateDict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and raw bytes, in key order. It is the
    content identity of a file: the same numbers give the same hash whatever the file name."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _signing_message(metadata: Mapping[str, str]) -> bytes:
    unsigned = {key: value for key, value in metadata.items() if key != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def sign(metadata: Mapping[str, str], secret: bytes) -> str:
    """HMAC-SHA256 (hex) of every metadata field except ``signature``."""
    return hmac.new(secret, _signing_message(metadata), hashlib.sha256).hexdigest()


def check_signature(metadata: Mapping[str, str], secret: bytes | None, what: str) -> None:
    """With a secret, the file must carry a valid signature; without one, any is ignored."""
    if secret is None:
        return
    signature = metadata.get("signature")
    if not signature:
        raise Rejected(RejectionReason.UNSIGNED, f"{what} is not signed but a secret is set")
    if not hmac.compare_digest(signature, sign(metadata, secret)):
        raise Rejected(RejectionReason.BAD_SIGNATURE, f"{what} signature does not verify")


# -- generic file encoding -------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: tensor entries (dtype tag, shape) and metadata."""

    entries: Mapping[str, tuple[str, tuple[int, ...]]]
    metadata: Mapping[str, str]


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NESTING_CHUNK = 1 << 22


def json_nesting_depth(text: bytes) -> int:
    """The deepest ``[``/``{`` nesting of JSON ``text`` (brackets inside strings do not
    count), in time linear in the length and without recursion."""
    skeleton = _JSON_STRING.sub(b'""', text).translate(None, _NOT_BRACKETS)
    brackets = np.frombuffer(skeleton, dtype=np.uint8)
    depth = deepest = 0
    for start in range(0, len(brackets), _NESTING_CHUNK):
        chunk = brackets[start : start + _NESTING_CHUNK]
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1)
        running = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def load_json(data: bytes | str, what: str, *, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Parse untrusted JSON with bounded work; ``Rejected(CORRUPT)`` for anything that is
    not UTF-8 JSON nested at most ``max_depth`` deep (huge integers included)."""
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogatepass")  # a lone surrogate fails below
    if json_nesting_depth(data) > max_depth:
        raise Rejected(RejectionReason.CORRUPT, f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Rejected(RejectionReason.CORRUPT, f"{what} is not JSON: {exc}") from None


_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
"""Bytes per element of the safetensors dtypes a hub file may hold."""


def _entry(key: str, entry: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """One tensor entry of a header: dtype tag, shape, data offsets (checked to agree)."""
    if not isinstance(entry, dict):
        raise Rejected(RejectionReason.CORRUPT, f"bad header entry for {key!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        raise Rejected(RejectionReason.CORRUPT, f"bad header entry for {key!r}")
    if dtype not in _DTYPE_BYTES:
        raise Rejected(RejectionReason.CORRUPT, f"unknown dtype {dtype[:20]!r} for {key!r}")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise Rejected(RejectionReason.CORRUPT, f"bad shape for {key!r}")
    if len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise Rejected(RejectionReason.CORRUPT, f"bad data offsets for {key!r}")
    begin, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    if end - begin != numel * _DTYPE_BYTES[dtype]:
        raise Rejected(RejectionReason.CORRUPT, f"data offsets of {key!r} disagree with its shape")
    return dtype, tuple(shape), (begin, end)


def parse_header(data: bytes) -> Header:
    """Read a safetensors header without loading tensors; ``Rejected(CORRUPT)`` if the
    bytes are not a well-formed safetensors file header. The header's length, nesting and
    tensor sizes are checked against the file's size before anything is loaded: every
    entry's offsets must match its dtype and shape, and the entries must tile the rest of
    the file exactly."""
    if len(data) < 8:
        raise Rejected(RejectionReason.CORRUPT, f"file too short ({len(data)} bytes)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(data):
        raise Rejected(RejectionReason.CORRUPT, f"bad header length {length}")
    raw = load_json(data[8 : 8 + length], "header")
    if not isinstance(raw, dict):
        raise Rejected(RejectionReason.CORRUPT, "header is not a JSON object")
    metadata_raw = raw.pop("__metadata__", {})
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise Rejected(RejectionReason.CORRUPT, "header metadata is not a string map")
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int]] = []
    for key, entry in raw.items():
        dtype, shape, span = _entry(key, entry)
        entries[key] = (dtype, shape)
        spans.append(span)
    _check_spans(spans, len(data) - 8 - length)
    return Header(entries=entries, metadata=dict(metadata_raw))


def _check_spans(spans: list[tuple[int, int]], payload_bytes: int) -> None:
    """The tensors' byte ranges must cover the payload exactly, without gaps or overlaps."""
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise Rejected(RejectionReason.CORRUPT, "tensor data ranges overlap or leave gaps")
        position = end
    if position != payload_bytes:
        raise Rejected(
            RejectionReason.CORRUPT,
            f"header describes {position} bytes of tensor data, the file holds {payload_bytes}",
        )


def encode_file(
    kind: str,
    tensors: StateDict,
    fields: Mapping[str, str],
    *,
    fingerprint: str,
    secret: bytes | None,
) -> bytes:
    """Serialise ``tensors`` with the common metadata, hashed and (optionally) signed.

    Tensors are detached, moved to CPU and cloned (a tied weight would otherwise share
    storage, which safetensors refuses).
    """
    clean = {key: value.detach().to("cpu").contiguous().clone() for key, value in tensors.items()}
    metadata: dict[str, str] = {
        "format": FORMAT,
        "kind": kind,
        "fingerprint": fingerprint,
        "numel": str(sum(t.numel() for t in clean.values())),
        "sha256": payload_sha256(clean),
        **fields,
    }
    if secret is not None:
        metadata["signature"] = sign(metadata, secret)
    return safetensors.torch.save(clean, metadata=metadata)


def require_fields(metadata: Mapping[str, str], names: Iterable[str], what: str) -> None:
    missing = [name for name in names if name not in metadata]
    if missing:
        raise Rejected(RejectionReason.BAD_METADATA, f"{what} lacks metadata {missing}")


def metadata_fields(metadata: Mapping[str, str], what: str, required: Iterable[str] = ()) -> Fields:
    """Every declared field of ``metadata`` checked against its type and bounds
    (``fields.FIELDS``); ``Rejected(BAD_METADATA)`` naming the first one that fails."""
    try:
        return parse_fields(metadata, what, required)
    except FieldError as exc:
        raise Rejected(RejectionReason.BAD_METADATA, str(exc)) from None


@dataclass(frozen=True)
class DecodedFile:
    """A validated file: its tensors as stored, its metadata and payload hash."""

    tensors: dict[str, torch.Tensor]
    metadata: Mapping[str, str]
    sha256: str
    size: int
    fields: Fields
    """The metadata's declared fields, typed and bounded (``fields.parse_fields``)."""


def decode_file(
    data: bytes,
    kind: str,
    *,
    fingerprint: str,
    secret: bytes | None,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    allowed_dtypes: Mapping[str, torch.dtype] | None,
    what: str,
) -> DecodedFile:
    """Check format, kind, signature, every declared metadata field's type and bounds,
    fingerprint, keys/shapes, element count, payload hash and finiteness, in that order;
    raise ``Rejected`` at the first failure."""
    header = parse_header(data)
    meta = header.metadata
    require_fields(meta, ("format", "kind", "fingerprint", "numel", "sha256"), what)
    if meta["format"] != FORMAT:
        raise Rejected(RejectionReason.BAD_METADATA, f"{what} has format {meta['format']!r}")
    if meta["kind"] != kind:
        raise Rejected(RejectionReason.BAD_METADATA, f"{what} is a {meta['kind']!r} file")
    check_signature(meta, secret, what)
    fields = metadata_fields(meta, what)
    if meta["fingerprint"] != fingerprint:
        raise Rejected(
            RejectionReason.FOREIGN_FINGERPRINT,
            f"{what} was made by model {meta['fingerprint']!r}, this run is {fingerprint!r}",
        )
    if expected_shapes is not None:
        _check_entries(header, expected_shapes, what)
    if allowed_dtypes is not None:
        bad = sorted(k for k, (dtype, _) in header.entries.items() if dtype not in allowed_dtypes)
        if bad:
            raise Rejected(RejectionReason.WRONG_DTYPE, f"{what} has unexpected dtypes in {bad}")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # the library raises several types for damaged payloads
        raise Rejected(RejectionReason.CORRUPT, f"{what} payload unreadable: {exc}") from None
    numel = sum(t.numel() for t in tensors.values())
    if numel != fields.integer("numel"):
        raise Rejected(
            RejectionReason.ELEMENT_COUNT, f"{what} holds {numel} elements, says {meta['numel']}"
        )
    digest = payload_sha256(tensors)
    if not hmac.compare_digest(digest, meta["sha256"]):
        raise Rejected(RejectionReason.BAD_HASH, f"{what} payload hash does not match")
    for key, tensor in tensors.items():
        if is_synchronised(tensor) and not bool(torch.isfinite(tensor).all()):
            raise Rejected(RejectionReason.NON_FINITE, f"{what} has NaN/Inf in {key!r}")
    return DecodedFile(tensors=tensors, metadata=meta, sha256=digest, size=len(data), fields=fields)


def _check_entries(header: Header, expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(expected) - set(header.entries))
    extra = sorted(set(header.entries) - set(expected))
    if missing or extra:
        raise Rejected(
            RejectionReason.WRONG_KEYS,
            f"{what} keys differ: missing {missing[:5] or 'none'}, "
            f"unexpected {extra[:5] or 'none'}",
        )
    for key, shape in expected.items():
        if header.entries[key][1] != tuple(shape):
            raise Rejected(
                RejectionReason.WRONG_SHAPES,
                f"{what} shape for {key!r} is {header.entries[key][1]}, expected {shape}",
            )
