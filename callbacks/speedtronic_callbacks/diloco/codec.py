"""The ``Codec`` interface: how a pseudo-gradient's values travel (``delta_dtype``).

A codec turns one flat float32 vector (the concatenation of every synchronised tensor, in
the model layout's key order) into its payload and back, has one name on the wire (the
``encoding`` field of a delta file, the ``delta_dtype`` option) and says how many bytes a
payload of ``n`` values takes. Two families share that interface:

* ``CastCodec`` -- the values travel as one float dtype (``dtype``), per key in hub files
  and as one all-reduced buffer in collective mode;
* ``BlockCodec`` -- the values travel as ``Packed`` codes (``uint8``) plus one float32
  scale ``max|x| / top`` per block of ``block_size`` values; a subclass says only how a
  scaled value becomes a code and back (``quantise``/``dequantise``) and how many code
  bytes ``n`` values take. Validation of untrusted codes and scales is here, once.

The codecs themselves are one class each in ``diloco/codecs/`` and are looked up by name
in its registry (``codec_named``); the file format (``wire``) and the collective exchange
branch on the family, never on a codec's name.

Non-finite input is refused (``ValueError``): a NaN/Inf pseudo-gradient must never be
sent. ``BlockCodec.unpack`` refuses codes or scales whose sizes do not match the element
count (``PackingError``) and scales that are negative or not finite, so a damaged or
hostile file is rejected, never decoded to junk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["BLOCK_SIZE", "BlockCodec", "CastCodec", "Codec", "Packed", "PackingError", "Payload"]

BLOCK_SIZE = 64
"""Values per scale of the block codecs (``docs/distributed.md``, "Delta encodings")."""


class PackingError(ValueError):
    """Packed data whose sizes or scales do not fit its header; the message says how."""


@dataclass(frozen=True)
class Packed:
    """A flat vector of ``numel`` values in a block codec: ``codes`` (uint8) and one
    float32 ``scales`` entry per block of ``block_size`` values."""

    codec: BlockCodec
    numel: int
    block_size: int
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def encoding(self) -> BlockCodec:
        """The codec (its name before codecs were classes)."""
        return self.codec

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


Payload = torch.Tensor | Packed
"""What ``Codec.encode`` gives: a cast vector, or packed codes and scales."""


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _flat_float32(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as a finite float32 CPU vector; ``ValueError`` for NaN/Inf values."""
    values = flat.detach().reshape(-1).to("cpu", torch.float32)
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise ValueError("cannot encode a pseudo-gradient with NaN/Inf values")
    return values


class Codec(ABC):
    """One ``delta_dtype``: its wire name, its payload and its size accounting."""

    name: ClassVar[str]
    """The name on the wire and in config (``encoding`` metadata, ``delta_dtype``)."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other names that select this codec (``none``, ``compression``'s name for fp32)."""
    lossy: ClassVar[bool] = True
    """Whether a round trip may change values (error feedback applies)."""
    packed: ClassVar[bool]
    """Whether the values travel as block-scaled ``Packed`` codes."""

    @property
    def value(self) -> str:
        """The name (what ``Encoding``'s enum members called ``value``)."""
        return self.name

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> Payload:
        """``flat`` as it travels; ``ValueError`` for NaN/Inf values."""

    @abstractmethod
    def decode(self, payload: Payload) -> torch.Tensor:
        """The float32 values of ``encode``'s result."""

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Bytes ``numel`` values take in this codec, scales included."""

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        """What ``flat`` becomes after travelling in this codec (float32)."""
        return self.decode(self.encode(flat))

    def bytes_per_value(self) -> float:
        """Bytes per value of a long vector, scales included."""
        count = BLOCK_SIZE * 1024
        return self.nbytes(count) / count

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class CastCodec(Codec):
    """Values cast to one float ``dtype`` (a whole-tensor payload, all-reducible)."""

    packed: ClassVar[bool] = False
    dtype: ClassVar[torch.dtype]
    falls_back: ClassVar[bool] = False
    """Whether ``send_dtype`` may send float32 instead of ``dtype`` (a file of float32
    entries then records ``fp32``)."""

    def send_dtype(self, tensors: list[torch.Tensor]) -> torch.dtype:
        """The dtype ``tensors`` are sent in (``dtype``; a codec whose range some values
        exceed may fall back to float32 instead of sending Inf)."""
        del tensors
        return self.dtype

    def encode(self, flat: torch.Tensor) -> Payload:
        return _flat_float32(flat).to(self.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        if isinstance(payload, Packed):
            raise PackingError(f"{self.name} is a cast codec, not a packed one")
        return payload.to(torch.float32)

    def nbytes(self, numel: int) -> int:
        return numel * torch.empty((), dtype=self.dtype).element_size()


class BlockCodec(Codec):
    """Block-scaled codes: ``scale = max|x| / top`` per block of ``block_size`` values,
    each value ``x / scale`` turned into a code by ``quantise`` (see the module docstring)."""

    packed: ClassVar[bool] = True
    top: ClassVar[float]
    """The largest code magnitude: a block's peak maps onto it."""

    @abstractmethod
    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` values (without scales)."""

    @abstractmethod
    def quantise(self, scaled: torch.Tensor) -> torch.Tensor:
        """The ``uint8`` codes of values already divided by their block's scale."""

    @abstractmethod
    def dequantise(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``numel`` float32 values (before scaling) of ``code_bytes(numel)`` codes."""

    def nbytes(self, numel: int, block_size: int = BLOCK_SIZE) -> int:
        return self.code_bytes(numel) + 4 * _blocks(numel, block_size)

    def encode(self, flat: torch.Tensor) -> Payload:
        return self.pack(flat)

    def decode(self, payload: Payload) -> torch.Tensor:
        if not isinstance(payload, Packed):
            raise PackingError(f"{self.name} is a packed codec: decode its Packed codes")
        return self.unpack(payload)

    def pack(self, flat: torch.Tensor, block_size: int = BLOCK_SIZE) -> Packed:
        """Encode a flat float vector into codes and per-block scales."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        values = _flat_float32(flat)
        numel = values.numel()
        blocks = _blocks(numel, block_size)
        padded = torch.zeros(blocks * block_size, dtype=torch.float32)
        padded[:numel] = values
        rows = padded.view(blocks, block_size)
        peak = rows.abs().amax(dim=1) if numel else torch.zeros(0)
        scales = peak / self.top
        # A block of zeros keeps scale 0 (decodes to zeros); divide by 1 there instead.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        scaled = (rows / divisor).reshape(-1)[:numel]
        codes = self.quantise(scaled)
        return Packed(self, numel, block_size, codes.contiguous(), scales.contiguous())

    def unpack(self, packed: Packed) -> torch.Tensor:
        """The float32 values of ``packed``; ``PackingError`` when its codes or scales do
        not fit ``numel`` and ``block_size``, or a scale is negative or not finite."""
        numel, block_size = packed.numel, packed.block_size
        if numel < 0 or block_size < 1:
            raise PackingError(f"bad element count {numel} or block size {block_size}")
        codes, scales = packed.codes.reshape(-1), packed.scales.reshape(-1)
        if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise PackingError(
                f"codes must be uint8 and scales float32, got {codes.dtype} and {scales.dtype}"
            )
        expected_codes = self.code_bytes(numel)
        if codes.numel() != expected_codes:
            raise PackingError(
                f"{self.name} codes hold {codes.numel()} bytes, {numel} values need "
                f"{expected_codes}"
            )
        expected_scales = _blocks(numel, block_size)
        if scales.numel() != expected_scales:
            raise PackingError(
                f"{self.name} has {scales.numel()} scales, {numel} values in blocks of "
                f"{block_size} need {expected_scales}"
            )
        if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise PackingError(f"{self.name} scales must be finite and >= 0")
        values = self.dequantise(codes, numel)
        return values * scales.repeat_interleave(block_size)[:numel]
