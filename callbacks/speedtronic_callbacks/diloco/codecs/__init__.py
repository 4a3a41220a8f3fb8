"""The codec registry: every ``delta_dtype`` by name (``docs/distributed.md``, "Delta
encodings").

A codec is one class (``diloco.codec.Codec``) in one file here, plus one
``register_codec`` line below; the wire format, the hub node, the master and the
collective exchange find it by its name. A codec of another package registers itself the
same way (``register_codec(MyCodec())``) before a run starts; every process of a run must
register the same codecs (collective mode checks that the replicas use the same one).
"""

from __future__ import annotations

from typing import Literal, TypeVar

from speedtronic_callbacks.diloco.codec import CastCodec, Codec
from speedtronic_callbacks.diloco.codecs.cast import BF16Codec, FP16Codec, FP32Codec
from speedtronic_callbacks.diloco.codecs.fp4 import FP4Codec
from speedtronic_callbacks.diloco.codecs.int8 import Int8Codec

__all__ = [
    "BF16",
    "FP16",
    "FP32",
    "FP4",
    "INT8",
    "CodecName",
    "cast_codecs",
    "codec_named",
    "find_codec",
    "register_codec",
    "registered_codecs",
    "unregister_codec",
]

CodecName = Literal["fp32", "bf16", "fp16", "int8", "fp4"]
"""The built-in codecs' names: the values the ``delta_dtype`` option accepts (a test keeps
it equal to the registered built-ins)."""

_C = TypeVar("_C", bound=Codec)

_REGISTRY: dict[str, Codec] = {}
_ALIASES: dict[str, str] = {}


def register_codec(codec: _C) -> _C:
    """Make ``codec`` known by its name (and aliases); ``ValueError`` when a name is taken."""
    names = (codec.name, *codec.aliases)
    taken = [name for name in names if name in _REGISTRY or name in _ALIASES]
    if taken:
        raise ValueError(f"codec name(s) {taken} already registered")
    _REGISTRY[codec.name] = codec
    _ALIASES.update({alias: codec.name for alias in codec.aliases})
    return codec


def unregister_codec(name: str) -> None:
    """Forget the codec ``name`` (a test's toy codec); ``KeyError`` when unknown."""
    codec = _REGISTRY.pop(name)
    for alias in codec.aliases:
        _ALIASES.pop(alias, None)


def registered_codecs() -> tuple[Codec, ...]:
    """Every known codec, in registration order (the built-ins first)."""
    return tuple(_REGISTRY.values())


def cast_codecs() -> tuple[CastCodec, ...]:
    """The registered codecs whose values travel as one float dtype."""
    return tuple(codec for codec in _REGISTRY.values() if isinstance(codec, CastCodec))


def find_codec(name: str) -> Codec | None:
    """The codec called ``name`` (or one of its aliases); ``None`` when there is none."""
    return _REGISTRY.get(_ALIASES.get(name, name))


def codec_named(name: str) -> Codec:
    """The codec called ``name``; ``ValueError`` naming the known ones otherwise."""
    codec = find_codec(name)
    if codec is None:
        known = ", ".join(_REGISTRY)
        raise ValueError(f"unknown delta encoding {name!r} (known: {known})")
    return codec


FP32 = register_codec(FP32Codec())
BF16 = register_codec(BF16Codec())
FP16 = register_codec(FP16Codec())
INT8 = register_codec(Int8Codec())
FP4 = register_codec(FP4Codec())
