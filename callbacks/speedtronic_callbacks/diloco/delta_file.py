"""Delta files: a node's pseudo-gradient on the hub, in its codec (``diloco.codecs``).

A delta holds one tensor per synchronised key (a ``CastCodec``: fp32/bf16/fp16), or the
packed ``codes`` and ``scales`` of the flattened delta (a ``BlockCodec``: int8/fp4); of the
whole model, or -- with a ``fragment`` field ``"p/P"`` -- of exactly the keys of streaming
fragment ``p`` of ``P`` (``fragments.layout_plan``; a packed fragment flattens just those
keys). The codec's name is the signed ``encoding`` field; a block codec's file also records
``block_size`` and ``values``. The file itself is a ``signed_file``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

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
from speedtronic_callbacks.diloco.fields import FRAGMENT_PATTERN, Fields
from speedtronic_callbacks.diloco.fragments import layout_plan
from speedtronic_callbacks.diloco.math import StateDict, flatten, unflatten
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.signed_file import (
    DecodedFile,
    Rejected,
    RejectionReason,
    decode_file,
    encode_file,
    parse_header,
    require_fields,
)

_SAFETENSORS_TAGS = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"
}  # fmt: skip
"""The safetensors dtype tag of each float dtype a cast codec may send."""


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
