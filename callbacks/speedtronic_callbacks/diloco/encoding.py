"""The ``delta_dtype`` codecs under their earlier names (kept for code that imports them).

Every name here resolves to the one concept, ``diloco.codec.Codec`` and its registry
``diloco.codecs``: ``Encoding.FP4`` *is* the ``fp4`` codec (``codecs.FP4``),
``Encoding("int8")`` and ``Encoding.parse("none")`` look a codec up by name, iterating
``Encoding`` gives the registered codecs, and the functions below call the codec's
methods (``pack(flat, codec)`` is ``codec.pack(flat)``). ``Compression`` (the 2.0 name,
also importable from ``diloco`` and ``diloco.wire``) holds the ``compression`` option's
three codecs the same way. New code uses the codecs directly.
Formats, sizes and error bounds: ``diloco.codec`` and the codec modules in
``diloco/codecs/``; docs/distributed.md, "Delta encodings".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from speedtronic_callbacks.diloco import codecs
from speedtronic_callbacks.diloco.codec import (
    BLOCK_SIZE,
    BlockCodec,
    CastCodec,
    Codec,
    Packed,
    PackingError,
    Payload,
)
from speedtronic_callbacks.diloco.codecs.fp4 import E2M1_VALUES

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "Compression",
    "Encoding",
    "Packed",
    "PackingError",
    "bytes_per_value",
    "pack",
    "packed_bytes",
    "round_trip",
    "unpack",
]


class _CodecNamespace(type):
    """``Encoding``'s behaviour as a class: calling it looks a codec up by name,
    iterating it lists the registered codecs."""

    def __call__(cls, name: str) -> Codec:
        return codecs.codec_named(name)

    def __iter__(cls) -> Iterator[Codec]:
        return iter(codecs.registered_codecs())


class Encoding(metaclass=_CodecNamespace):
    """The earlier name of the codecs (an enum before codecs were classes): its members
    are the registered codec objects themselves."""

    FP32: ClassVar[CastCodec] = codecs.FP32
    BF16: ClassVar[CastCodec] = codecs.BF16
    FP16: ClassVar[CastCodec] = codecs.FP16
    INT8: ClassVar[BlockCodec] = codecs.INT8
    FP4: ClassVar[BlockCodec] = codecs.FP4

    @staticmethod
    def parse(value: str) -> Codec:
        """The codec named ``value`` (``none`` is fp32); ``ValueError`` naming the known ones."""
        return codecs.codec_named(value)


class _CompressionNamespace(type):
    """``Compression``'s behaviour as a class: calling it looks up one of its three names."""

    def __call__(cls, name: str) -> CastCodec:
        if name not in _COMPRESSION_NAMES:
            raise ValueError(f"{name!r} is not a valid Compression (none, bf16, fp16)")
        codec = codecs.codec_named(name)
        assert isinstance(codec, CastCodec)
        return codec

    def __iter__(cls) -> Iterator[CastCodec]:
        return iter((codecs.FP32, codecs.BF16, codecs.FP16))


_COMPRESSION_NAMES = ("none", "bf16", "fp16")


class Compression(metaclass=_CompressionNamespace):
    """The ``compression`` option's values under their earlier Python name (an enum of
    ``diloco.wire`` before codecs were classes): ``Compression.NONE`` is the fp32 codec,
    ``Compression.BF16``/``FP16`` the bf16/fp16 ones, ``Compression("bf16")`` looks one up."""

    NONE: ClassVar[CastCodec] = codecs.FP32
    BF16: ClassVar[CastCodec] = codecs.BF16
    FP16: ClassVar[CastCodec] = codecs.FP16


def _block(codec: Codec) -> BlockCodec:
    if not isinstance(codec, BlockCodec):
        raise ValueError(f"{codec.name} is not a packed encoding")
    return codec


def code_bytes(codec: Codec, numel: int) -> int:
    """Bytes of the codes of ``numel`` values (without scales)."""
    return codec.code_bytes(numel) if isinstance(codec, BlockCodec) else codec.nbytes(numel)


def packed_bytes(codec: Codec, numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Bytes ``numel`` values take in ``codec``, scales included."""
    if isinstance(codec, BlockCodec):
        return codec.nbytes(numel, block_size)
    return codec.nbytes(numel)


def bytes_per_value(codec: Codec, block_size: int = BLOCK_SIZE) -> float:
    """Bytes per value of a long vector in ``codec``, scales included."""
    count = block_size * 1024
    return packed_bytes(codec, count, block_size) / count


def pack(flat: torch.Tensor, codec: Codec, block_size: int = BLOCK_SIZE) -> Packed:
    """``codec.pack``: a flat float vector as int8/fp4 codes and scales."""
    return _block(codec).pack(flat, block_size)


def unpack(packed: Packed) -> torch.Tensor:
    """``packed.codec.unpack``: the float32 values; ``PackingError`` on a misfit."""
    return packed.codec.unpack(packed)


def _encode_flat(flat: torch.Tensor, codec: Codec) -> Payload:
    """``codec.encode``: ``flat`` as it travels."""
    return codec.encode(flat)


def round_trip(flat: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``codec.round_trip``: what ``flat`` becomes after travelling in ``codec``."""
    return codec.round_trip(flat)
