"""The wire format: what DiLoCo nodes exchange, safetensors with signed metadata.

Three kinds of tensor file share one format (``FORMAT``):

* ``delta``  -- a node's pseudo-gradient, in its ``encoding`` (``diloco.encoding``):
  one tensor per synchronised key (fp32/bf16/fp16), or the packed ``codes`` and ``scales``
  of the flattened delta (int8/fp4); of the whole model, or -- with a ``fragment`` field
  ``"p/P"`` -- of exactly the keys of streaming fragment ``p`` of ``P``
  (``fragments.layout_plan``; a packed fragment flattens just those keys);
* ``global`` -- the master's full model state after an outer step (native dtypes);
* ``outer``  -- the master's outer-optimizer momentum plus its ledger (float32).

Every file carries, as safetensors header metadata (all strings): the format, its kind, a
model/config fingerprint, the element count, the sha256 of the tensor payload and, when a
shared secret is configured, an HMAC-SHA256 signature over all other metadata fields
(which includes the payload hash, so the signature covers the tensors too).

Decoding never trusts a file: ``decode_*`` either returns validated float tensors or
raises ``Rejected`` with a typed ``RejectionReason``; it never raises anything else on bad
input. The pointer that names the current global files is in ``pointer``; what a model's
files must contain (``ModelLayout``) in ``model_layout``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import safetensors.torch
import torch

from speedtronic_callbacks.diloco.codec import (
    BLOCK_SIZE,
    BlockCodec,
    CastCodec,
    Codec,
    Packed,
    PackingError,
)
from speedtronic_callbacks.diloco.codecs import FP32, cast_codecs, find_codec, registered_codecs
from speedtronic_callbacks.diloco.encoding import Compression as Compression  # its earlier home
from speedtronic_callbacks.diloco.fields import (
    FRAGMENT_PATTERN,
    FieldError,
    Fields,
    check_integer,
    parse_fields,
)
from speedtronic_callbacks.diloco.fragments import layout_plan
from speedtronic_callbacks.diloco.math import StateDict, flatten, is_synchronised, unflatten
from speedtronic_callbacks.diloco.model_layout import ModelLayout

FORMAT = "speedtronic-diloco/1"
"""The value of the ``format`` metadata field; other formats are rejected."""

MAX_HEADER_BYTES = 64 * 1024 * 1024
"""Refuse safetensors headers larger than this (a hostile file could claim gigabytes)."""

MAX_JSON_DEPTH = 8
"""The deepest JSON nesting accepted anywhere in a hub file (real files nest 3 deep).
Checked before parsing, so a 100,000-deep header is a rejection, not a RecursionError."""


_SAFETENSORS_TAGS = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"
}  # fmt: skip
"""The safetensors dtype tag of each float dtype a cast codec may send."""


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


# -- deltas -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaInfo:
    """Who made a delta, from which global it started and how much it trained since
    (``tokens``/``samples``: 0 when unknown; the master weights deltas by them).

    ``first_step`` and ``local_step`` are the delta's step range: it holds the node's
    progress of local steps ``first_step + 1 .. local_step`` (``None``: files of earlier
    versions, which do not say). The master applies no two deltas of one node incarnation
    whose ranges overlap (docs/distributed.md, "Restarts")."""

    node_id: str
    local_step: int
    base_outer_step: int
    incarnation: str = ""
    tokens: int = 0
    samples: int = 0
    fragment: str = ""
    """``"p/P"``: the delta holds streaming fragment ``p`` of ``P``; ``""``: the whole model."""
    first_step: int | None = None

    @property
    def steps(self) -> int | None:
        """How many local steps the delta's range spans (``None`` when it has none)."""
        return None if self.first_step is None else self.local_step - self.first_step


PACKED_KEYS = ("codes", "scales")
"""The entries of an int8/fp4 delta file: the packed codes and the per-block scales of the
delta flattened in the layout's key order."""

MAX_BLOCK_SIZE = 1 << 20
"""The largest ``block_size`` a packed delta file may declare."""

_PACKED_DTYPES = {"U8": torch.uint8, "F32": torch.float32}


def flatten_delta(delta: StateDict, layout: ModelLayout) -> torch.Tensor:
    """One float32 vector: the delta's entries in the layout's key order."""
    return flatten(delta, layout.sync_keys)


def unflatten_delta(flat: torch.Tensor, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """``flatten_delta``'s inverse: per-key float32 tensors in their wire shapes."""
    return unflatten(flat, {key: layout.wire_shapes[key] for key in layout.sync_keys})


def _cast_codec(codec: Codec) -> CastCodec:
    """A codec that is not block-scaled must cast: the file format has those two kinds."""
    if not isinstance(codec, CastCodec):
        raise TypeError(f"codec {codec.name!r} is neither a CastCodec nor a BlockCodec")
    return codec


def to_wire(
    delta: StateDict, layout: ModelLayout, compression: Codec = FP32
) -> dict[str, torch.Tensor]:
    """The delta's tensors as they travel in codec ``compression``: cast to its dtype (per
    key; ``CastCodec.send_dtype``: an fp16 delta with values beyond the fp16 range is sent
    in float32 instead of overflowing to Inf), or packed into ``PACKED_KEYS``."""
    if isinstance(compression, BlockCodec):
        packed = compression.pack(flatten_delta(delta, layout))
        return {"codes": packed.codes, "scales": packed.scales}
    dtype = _cast_codec(compression).send_dtype(list(delta.values()))
    return {key: delta[key].to(dtype) for key in layout.sync_keys}


def wire_encoding(wire: StateDict) -> Codec:
    """The cast codec of ``to_wire``'s result, read from its entries' dtypes (fp32 when
    they are mixed)."""
    if set(wire) == set(PACKED_KEYS):
        raise ValueError("a packed delta's encoding cannot be told from its tensors")
    dtypes = {tensor.dtype for tensor in wire.values()}
    for codec in cast_codecs():
        if dtypes == {codec.dtype}:
            return codec
    return FP32


def from_wire(wire: StateDict, layout: ModelLayout, codec: Codec) -> dict[str, torch.Tensor]:
    """What a receiver decodes from ``to_wire``'s result: float32 per key."""
    if isinstance(codec, BlockCodec):
        packed = Packed(codec, layout.sync_numel, BLOCK_SIZE, wire["codes"], wire["scales"])
        return unflatten_delta(codec.unpack(packed), layout)
    return {key: wire[key].to(torch.float32) for key in layout.sync_keys}


def encode_wire(
    wire: StateDict,
    info: DeltaInfo,
    layout: ModelLayout,
    *,
    secret: bytes | None = None,
    encoding: Codec | None = None,
) -> bytes:
    """A delta file from tensors already in their wire form (see ``to_wire``). The
    ``encoding`` (read from the tensors' dtypes when not given; required for int8/fp4) is
    recorded in the signed metadata, with the block size and value count of a packed one.
    ``layout`` is the whole model's, also for a fragment's delta (``info.fragment``)."""
    encoding = encoding or wire_encoding(wire)
    if isinstance(encoding, CastCodec) and encoding.falls_back:
        if any(t.dtype == torch.float32 for t in wire.values()):
            encoding = FP32  # to_wire's overflow fallback (``send_dtype``)
    fields = {
        "node_id": info.node_id,
        "local_step": str(info.local_step),
        "base_outer_step": str(info.base_outer_step),
        "incarnation": info.incarnation,
        "encoding": encoding.name,
        "tokens": str(info.tokens),
        "samples": str(info.samples),
    }
    if info.first_step is not None:
        fields["first_step"] = str(info.first_step)
    if isinstance(encoding, BlockCodec):
        fields["block_size"] = str(BLOCK_SIZE)
        fields["values"] = str(fragment_layout(layout, info.fragment).sync_numel)
    if info.fragment:
        fields["fragment"] = info.fragment
    return encode_file("delta", wire, fields, fingerprint=layout.fingerprint, secret=secret)


def encode_delta(
    delta: StateDict,
    info: DeltaInfo,
    layout: ModelLayout,
    *,
    compression: Codec = FP32,
    secret: bytes | None = None,
) -> bytes:
    """A delta file in codec ``compression``; with ``info.fragment``, of that streaming
    fragment's keys of ``delta``."""
    wire = to_wire(delta, fragment_layout(layout, info.fragment), compression)
    return encode_wire(wire, info, layout, secret=secret, encoding=compression)


@dataclass(frozen=True)
class DecodedDelta:
    """A validated delta as float32 tensors, with its origin, content hash and encoding."""

    info: DeltaInfo
    tensors: dict[str, torch.Tensor]
    sha256: str
    size: int
    encoding: Codec = FP32
    """The codec the file declares (its ``encoding`` field)."""


def _declared_encoding(data: bytes) -> Codec | str | None:
    """The codec a delta file's header declares (``encoding``, a codec's own name; an
    alias is no wire name): ``None`` when absent (files of earlier versions: float
    tensors per key), the name itself when it is unknown."""
    declared = parse_header(data).metadata.get("encoding")
    if declared is None:
        return None
    codec = find_codec(declared)
    return codec if codec is not None and codec.name == declared else declared


def decode_delta(data: bytes, layout: ModelLayout, *, secret: bytes | None) -> DecodedDelta:
    """Validate a delta file against ``layout``; ``Rejected`` on any problem: an encoding
    this version does not know is ``UNKNOWN_ENCODING`` (after the signature and
    fingerprint checks), packed data that does not fit its header ``BAD_PACKING``. A
    ``fragment`` field restricts the keys the file must hold to that fragment's."""
    declared = _declared_encoding(data)
    packed = isinstance(declared, BlockCodec)
    known = declared is None or isinstance(declared, Codec)
    fragment = parse_header(data).metadata.get("fragment", "")
    expected = fragment_layout(layout, fragment)
    decoded = decode_file(
        data,
        "delta",
        fingerprint=layout.fingerprint,
        secret=secret,
        expected_shapes=expected.wire_shapes if known and not packed else None,
        allowed_dtypes=(_PACKED_DTYPES if packed else _cast_dtypes()) if known else None,
        what="delta",
    )
    if isinstance(declared, str):
        known_names = ", ".join(codec.name for codec in registered_codecs())
        raise Rejected(
            RejectionReason.UNKNOWN_ENCODING,
            f"delta is encoded as {declared[:40]!r}; this version reads {known_names}",
        )
    require_fields(decoded.metadata, ("node_id", "local_step", "base_outer_step"), "delta")
    info = _delta_info(decoded.fields, fragment)
    encoding = declared or wire_encoding(decoded.tensors)
    if isinstance(encoding, BlockCodec):
        tensors = _unpack_delta(decoded, expected, encoding)
    else:
        tensors = {key: value.to(torch.float32) for key, value in decoded.tensors.items()}
    return DecodedDelta(
        info=info, tensors=tensors, sha256=decoded.sha256, size=decoded.size, encoding=encoding
    )


def _delta_info(fields: Fields, fragment: str) -> DeltaInfo:
    """The origin of a delta from its checked metadata (the required fields are there);
    ``Rejected(BAD_METADATA)`` for an empty step range."""
    local_step = fields.integer("local_step")
    first_step = fields.integer("first_step") if "first_step" in fields else None
    if first_step is not None and not first_step < local_step:
        raise Rejected(
            RejectionReason.BAD_METADATA,
            f"delta field 'first_step' {first_step} is not below its local_step {local_step}",
        )
    return DeltaInfo(
        node_id=fields.text("node_id"),
        local_step=local_step,
        base_outer_step=fields.integer("base_outer_step"),
        incarnation=fields.text("incarnation", ""),
        tokens=fields.integer("tokens", 0),
        samples=fields.integer("samples", 0),
        fragment=fragment,
        first_step=first_step,
    )


def _cast_dtypes() -> dict[str, torch.dtype]:
    """The safetensors tags a cast delta's entries may have: the registered cast codecs'."""
    return {_SAFETENSORS_TAGS[codec.dtype]: codec.dtype for codec in cast_codecs()}


def _unpack_delta(
    decoded: DecodedFile, layout: ModelLayout, encoding: BlockCodec
) -> dict[str, torch.Tensor]:
    """The float32 delta of a packed file; ``BAD_PACKING`` when the codes or scales do not
    fit the header (block size, value count) or the model."""
    tensors, fields = decoded.tensors, decoded.fields
    if set(tensors) != set(PACKED_KEYS):
        raise Rejected(
            RejectionReason.WRONG_KEYS,
            f"a {encoding.name} delta holds {sorted(tensors)[:5]}, expected {list(PACKED_KEYS)}",
        )
    require_fields(decoded.metadata, ("block_size", "values"), "delta")
    block_size = fields.integer("block_size")
    values = fields.integer("values")
    expected = layout.sync_numel
    if values != expected:
        raise Rejected(
            RejectionReason.BAD_PACKING,
            f"{encoding.name} delta says it holds {values} values, this model has {expected}",
        )
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise Rejected(RejectionReason.BAD_PACKING, f"block size {block_size} is out of range")
    codes, scales = tensors["codes"], tensors["scales"]
    if codes.dim() != 1 or scales.dim() != 1:
        raise Rejected(RejectionReason.BAD_PACKING, "packed codes and scales must be 1-D")
    try:
        flat = encoding.unpack(Packed(encoding, values, block_size, codes, scales))
    except PackingError as exc:
        raise Rejected(RejectionReason.BAD_PACKING, f"delta: {exc}") from None
    return unflatten_delta(flat, layout)


def fragment_shapes(layout: ModelLayout, fragment: str) -> Mapping[str, tuple[int, ...]]:
    """The keys and wire shapes a delta of ``fragment`` (``"p/P"``, or ``""`` for the whole
    model) must hold exactly -- a fragment is applied whole or not at all."""
    return fragment_layout(layout, fragment).wire_shapes


def fragment_layout(layout: ModelLayout, fragment: str) -> ModelLayout:
    """``layout`` restricted to the synchronised keys of ``fragment`` (``"p/P"``; ``""``:
    ``layout`` itself): what a fragment's delta file is encoded and checked against (its
    fingerprint stays the model's). ``Rejected`` (``BAD_METADATA``) for a malformed field."""
    if not fragment:
        return layout
    match = FRAGMENT_PATTERN.match(fragment)
    if match is None or not int(match[1]) < int(match[2]):
        raise Rejected(
            RejectionReason.BAD_METADATA,
            f"delta field 'fragment' {fragment!r:.20} is not 'p/P' with p < P",
        )
    try:
        plan = layout_plan(layout, int(match[2]))
    except ValueError as exc:
        raise Rejected(
            RejectionReason.BAD_METADATA, f"delta fragment {fragment!r}: {exc}"
        ) from None
    keys = plan.fragments[int(match[1])]
    shapes = {key: layout.wire_shapes[key] for key in keys}
    return dataclasses.replace(layout, sync_keys=keys, wire_shapes=shapes)


# -- global model and outer state ------------------------------------------------------


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


Progress = dict[str, tuple[str, int]]
"""node id -> (incarnation, highest local step applied from that incarnation)."""

Covered = dict[str, dict[str, dict[str, int]]]
"""node id -> incarnation -> streaming fragment -> highest local step applied from that
incarnation (fragment ``""``: whole-model deltas), for the ``MAX_INCARNATIONS`` newest
incarnations of each node. What the master checks a delta's step range against
(``Ledger.overlap``), and what a resumed node reads to skip what it sent."""

MAX_INCARNATIONS = 4
"""Incarnations per node whose applied step ranges the ledger keeps (a node restarted
from scratch while deltas of its earlier life still wait has two)."""


def progress_to_json(progress: Mapping[str, tuple[str, int]]) -> dict[str, dict[str, object]]:
    return {
        node: {"incarnation": incarnation, "step": step}
        for node, (incarnation, step) in sorted(progress.items())
    }


def _check_ids(node: object, incarnation: object) -> tuple[str, str]:
    """A node id and an incarnation from parsed JSON, checked like the metadata fields
    they come from; ``ValueError`` otherwise."""
    if not isinstance(node, str) or not isinstance(incarnation, str):
        raise ValueError(f"bad entry for node {node!r:.70}")
    try:
        metadata_fields({"node_id": node, "incarnation": incarnation}, "a node entry")
    except Rejected as exc:
        raise ValueError(exc.detail) from None
    return node, incarnation


def progress_from_json(raw: object) -> Progress:
    """Parse ``progress_to_json`` output (node ids, incarnations and steps checked like the
    metadata fields they come from); ``ValueError`` on anything else."""
    if not isinstance(raw, dict):
        raise ValueError("progress must be a JSON object")
    progress: Progress = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            raise ValueError(f"bad progress entry for {key!r:.70}")
        node, incarnation = _check_ids(key, entry.get("incarnation"))
        progress[node] = (incarnation, check_integer(entry.get("step"), "local_step"))
    return progress


def covered_to_json(covered: Covered) -> dict[str, dict[str, dict[str, int]]]:
    return {
        node: {incarnation: dict(sorted(steps.items())) for incarnation, steps in lives.items()}
        for node, lives in sorted(covered.items())
    }


def covered_from_json(raw: object) -> Covered:
    """Parse ``covered_to_json`` output (ids, fragments and steps checked, at most
    ``MAX_INCARNATIONS`` per node); ``ValueError`` on anything else."""
    if not isinstance(raw, dict):
        raise ValueError("covered must be a JSON object")
    covered: Covered = {}
    for key, lives in raw.items():
        if not isinstance(lives, dict) or len(lives) > MAX_INCARNATIONS:
            raise ValueError(f"bad covered entry for node {key!r:.70}")
        for life, steps in lives.items():
            node, incarnation = _check_ids(key, life)
            if not isinstance(steps, dict):
                raise ValueError(f"bad steps of node {node!r}")
            for fragment in steps:
                if fragment and not FRAGMENT_PATTERN.match(fragment):
                    raise ValueError(f"bad fragment {fragment!r:.20} of node {node!r}")
            checked = {f: check_integer(step, "local_step") for f, step in steps.items()}
            covered.setdefault(node, {})[incarnation] = checked
    return covered


def covered_through(steps: Mapping[str, int], fragment: str) -> int:
    """The highest local step applied that a delta of ``fragment`` would overlap: the
    fragment's own and whole-model deltas' for a fragment, every fragment's for a
    whole-model delta (-1: none)."""
    if fragment:
        return max(steps.get(fragment, -1), steps.get("", -1))
    return max(steps.values(), default=-1)


@dataclass
class Ledger:
    """The master's memory of what it has done, published with every outer step.

    ``applied`` holds the content hash of every delta ever applied (so a re-uploaded or
    renamed copy is never applied twice); ``progress`` the highest local step applied per
    node incarnation (what earlier versions' nodes read); ``covered`` the same per
    incarnation and streaming fragment, which the step range of every new delta of that
    incarnation must start at or after (``overlap``) and which a resumed node reads to
    skip what it sent.
    """

    applied: set[str] = field(default_factory=set)
    progress: Progress = field(default_factory=dict)
    covered: Covered = field(default_factory=dict)

    def copy(self) -> Ledger:
        covered = {
            node: {life: dict(steps) for life, steps in lives.items()}
            for node, lives in self.covered.items()
        }
        return Ledger(set(self.applied), dict(self.progress), covered)

    def overlap(self, info: DeltaInfo) -> int | None:
        """The highest local step already applied from ``info``'s node incarnation that
        ``info``'s range reaches back to, or ``None`` when it does not overlap. A delta of
        an earlier version (no range) overlaps when it ends there or before."""
        steps = self.covered.get(info.node_id, {}).get(info.incarnation)
        if steps is None:
            return None
        through = covered_through(steps, info.fragment)
        start = info.local_step - 1 if info.first_step is None else info.first_step
        return through if start < through else None

    def record(self, info: DeltaInfo) -> None:
        """Note that ``info``'s delta was applied (its incarnation becomes the node's
        newest; beyond ``MAX_INCARNATIONS`` the oldest is forgotten)."""
        node, incarnation = info.node_id, info.incarnation
        lives = self.covered.setdefault(node, {})
        steps = lives.pop(incarnation, {})
        steps[info.fragment] = max(steps.get(info.fragment, -1), info.local_step)
        lives[incarnation] = steps
        while len(lives) > MAX_INCARNATIONS:
            del lives[next(iter(lives))]
        previous = self.progress.get(node)
        step = info.local_step
        if previous is not None and previous[0] == incarnation:
            step = max(step, previous[1])
        self.progress[node] = (incarnation, step)

    def to_json(self) -> str:
        return json.dumps(
            {
                "applied": sorted(self.applied),
                "progress": progress_to_json(self.progress),
                "covered": covered_to_json(self.covered),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        """Parse ``to_json`` output; ``ValueError`` on anything else."""
        try:
            raw = load_json(text, "ledger")
        except Rejected as exc:
            raise ValueError(exc.detail) from None
        if not isinstance(raw, dict):
            raise ValueError("ledger is not a JSON object")
        applied = raw.get("applied", [])
        if not isinstance(applied, list) or not all(
            isinstance(h, str) and _APPLIED_HASH.match(h) for h in applied
        ):
            raise ValueError("ledger 'applied' must be a list of content hashes")
        return cls(
            applied=set(applied),
            progress=progress_from_json(raw.get("progress", {})),
            covered=covered_from_json(raw.get("covered", {})),
        )


_APPLIED_HASH = re.compile(r"^[0-9a-f]{16,64}$")
"""A ledger's hash: a full sha256, or the 16-character prefix of a file name."""


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
