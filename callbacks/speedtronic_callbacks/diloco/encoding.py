"""How a pseudo-gradient travels: the ``delta_dtype`` encodings and their codecs.

Five encodings (``Encoding``):

* ``fp32`` -- float32, exact;
* ``bf16`` / ``fp16`` -- a cast, 2 bytes per value;
* ``int8`` -- blocks of ``BLOCK_SIZE`` values share one float32 scale ``max|x| / 127``;
  each value is ``round(x / scale)`` in ``[-127, 127]``, one byte;
* ``fp4`` -- blocks of ``BLOCK_SIZE`` values share one float32 scale ``max|x| / 6``; each
  value is the nearest of the 16 e2m1 numbers ``{0, 0.5, 1, 1.5, 2, 3, 4, 6} x {+, -}``
  times the scale (ties go to the smaller magnitude), as a 4-bit code (sign bit, then the
  2-bit exponent and 1-bit mantissa of e2m1), two codes per byte (the first value in the
  low nibble; an odd count pads the last high nibble with zero).

The packed encodings work on one flat float32 vector (the concatenation of every
synchronised tensor, in the model layout's key order) and produce a ``Packed``: the codes
(``uint8``; for ``int8`` the bytes of the ``int8`` values) and the per-block scales.

Sizes, per value including the scales (``packed_bytes``; ``BLOCK_SIZE`` = 64):
``fp32`` 4 bytes, ``bf16``/``fp16`` 2, ``int8`` 1 + 4/64 = 1.0625, ``fp4`` 0.5 + 4/64 =
0.5625 -- ``fp4`` is 1/7.1 of ``fp32``. 64 is the smallest power of two for which fp4 with a
float32 scale stays below 1/7 of float32 (32 would give 0.625 bytes, 1/6.4).

Error bounds (per value ``x`` of a block whose largest magnitude is ``m``; the tests check
them): ``int8`` ``|x - x'| <= m / 254``; ``fp4`` ``|x - x'| <= max(m / 24, |x| / 4)``
(the e2m1 grid's half-gaps: 0.25 up to 2, 0.5 up to 4, 1 up to 6, in units of ``m / 6``);
both up to float32 rounding. A block of zeros decodes to zeros.

Non-finite input is refused (``ValueError``): a NaN/Inf pseudo-gradient must never be
sent (the node drops such a delta before it gets here). ``unpack`` refuses codes or
scales whose sizes do not match the element count (``PackingError``) and scales that are
negative or not finite, so a damaged or hostile file is rejected, never decoded to junk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK_SIZE",
    "Encoding",
    "Packed",
    "PackingError",
    "bytes_per_value",
    "decode_flat",
    "encode_flat",
    "pack",
    "packed_bytes",
    "round_trip",
    "unpack",
]

BLOCK_SIZE = 64
"""Values per scale in the ``int8`` and ``fp4`` encodings (see the module docstring)."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative e2m1 numbers; a value's index here is its 3-bit e2m1 code."""

_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2
_INT8_MAX = 127.0
_FP4_MAX = 6.0


class Encoding(str, enum.Enum):
    """A ``delta_dtype``: how a pseudo-gradient's values travel."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    FP4 = "fp4"

    @property
    def packed(self) -> bool:
        """Whether values travel as block-scaled codes (``int8``, ``fp4``)."""
        return self in (Encoding.INT8, Encoding.FP4)

    @property
    def lossy(self) -> bool:
        return self is not Encoding.FP32

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype a cast encoding travels in (``fp32``/``bf16``/``fp16`` only)."""
        dtypes = {
            Encoding.FP32: torch.float32,
            Encoding.BF16: torch.bfloat16,
            Encoding.FP16: torch.float16,
        }
        if self not in dtypes:
            raise ValueError(f"{self.value} is a packed encoding, not a float dtype")
        return dtypes[self]

    @classmethod
    def parse(cls, value: str) -> Encoding:
        """The encoding named ``value`` (``none`` is ``compression``'s name for fp32);
        ``ValueError`` naming the known ones otherwise."""
        if value == "none":
            return cls.FP32
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(item.value for item in cls)
            raise ValueError(f"unknown delta encoding {value!r} (known: {known})") from None


class PackingError(ValueError):
    """Packed data whose sizes or scales do not fit its header; the message says how."""


@dataclass(frozen=True)
class Packed:
    """A flat vector of ``numel`` values in a packed encoding: ``codes`` (uint8) and one
    float32 ``scales`` entry per block of ``block_size`` values."""

    encoding: Encoding
    numel: int
    block_size: int
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_bytes(encoding: Encoding, numel: int) -> int:
    """Bytes of the codes of ``numel`` values (without scales)."""
    if encoding is Encoding.FP4:
        return -(-numel // 2)
    if encoding is Encoding.INT8:
        return numel
    return numel * torch.empty((), dtype=encoding.float_dtype).element_size()


def packed_bytes(encoding: Encoding, numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Bytes ``numel`` values take in ``encoding``, scales included."""
    scales = 4 * _blocks(numel, block_size) if encoding.packed else 0
    return code_bytes(encoding, numel) + scales


def bytes_per_value(encoding: Encoding, block_size: int = BLOCK_SIZE) -> float:
    """Bytes per value of a long vector in ``encoding``, scales included."""
    count = block_size * 1024
    return packed_bytes(encoding, count, block_size) / count


def _check_finite(flat: torch.Tensor) -> None:
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise ValueError("cannot encode a pseudo-gradient with NaN/Inf values")


def _block_view(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as ``(blocks, block_size)``."""
    blocks = _blocks(flat.numel(), block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(blocks, block_size)


def pack(flat: torch.Tensor, encoding: Encoding, block_size: int = BLOCK_SIZE) -> Packed:
    """Encode a flat float vector in ``int8`` or ``fp4`` (see the module docstring)."""
    if not encoding.packed:
        raise ValueError(f"{encoding.value} is not a packed encoding")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    values = flat.detach().reshape(-1).to("cpu", torch.float32)
    _check_finite(values)
    numel = values.numel()
    blocks = _block_view(values, block_size)
    peak = blocks.abs().amax(dim=1) if numel else torch.zeros(0)
    top = _INT8_MAX if encoding is Encoding.INT8 else _FP4_MAX
    scales = peak / top
    # A block of zeros keeps scale 0 (decodes to zeros); divide by 1 there instead.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    scaled = (blocks / divisor).reshape(-1)[:numel]
    if encoding is Encoding.INT8:
        codes = scaled.round().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).view(torch.uint8)
    else:
        magnitude = torch.bucketize(scaled.abs().clamp_(max=_FP4_MAX), _E2M1_MIDPOINTS)
        nibbles = magnitude.to(torch.uint8) | (scaled < 0).to(torch.uint8) << 3
        if numel % 2:
            nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return Packed(encoding, numel, block_size, codes.contiguous(), scales.contiguous())


def unpack(packed: Packed) -> torch.Tensor:
    """The float32 values of ``packed``; ``PackingError`` when its codes or scales do not
    fit ``numel`` and ``block_size``, or a scale is negative or not finite."""
    encoding, numel, block_size = packed.encoding, packed.numel, packed.block_size
    if not encoding.packed:
        raise PackingError(f"{encoding.value} is not a packed encoding")
    if numel < 0 or block_size < 1:
        raise PackingError(f"bad element count {numel} or block size {block_size}")
    codes, scales = packed.codes.reshape(-1), packed.scales.reshape(-1)
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise PackingError(
            f"codes must be uint8 and scales float32, got {codes.dtype} and {scales.dtype}"
        )
    expected_codes = code_bytes(encoding, numel)
    if codes.numel() != expected_codes:
        raise PackingError(
            f"{encoding.value} codes hold {codes.numel()} bytes, {numel} values need "
            f"{expected_codes}"
        )
    expected_scales = _blocks(numel, block_size)
    if scales.numel() != expected_scales:
        raise PackingError(
            f"{encoding.value} has {scales.numel()} scales, {numel} values in blocks of "
            f"{block_size} need {expected_scales}"
        )
    if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise PackingError(f"{encoding.value} scales must be finite and >= 0")
    if encoding is Encoding.INT8:
        values = codes.view(torch.int8).to(torch.float32)
    else:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:numel]
        magnitude = _E2M1[(nibbles & 0x07).long()]
        values = torch.where((nibbles & 0x08).bool(), -magnitude, magnitude)
    per_value = scales.repeat_interleave(block_size)[:numel]
    return values * per_value


def encode_flat(flat: torch.Tensor, encoding: Encoding) -> torch.Tensor | Packed:
    """``flat`` as it travels: cast for fp32/bf16/fp16, ``pack`` for int8/fp4."""
    if encoding.packed:
        return pack(flat, encoding)
    values = flat.detach().reshape(-1).to("cpu", torch.float32)
    _check_finite(values)
    return values.to(encoding.float_dtype)


def decode_flat(encoded: torch.Tensor | Packed) -> torch.Tensor:
    """The float32 values of ``encode_flat``'s result."""
    if isinstance(encoded, Packed):
        return unpack(encoded)
    return encoded.to(torch.float32)


def round_trip(flat: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    """What ``flat`` becomes after travelling in ``encoding`` (float32)."""
    return decode_flat(encode_flat(flat, encoding))
