"""The metadata fields of hub files, each declared once with its type and bounds.

Every hub file carries string fields: a tensor file's safetensors metadata (``wire``), the
pointer's JSON object (``pointer``). A field is only ever read through ``parse_fields``,
which checks every field it knows against its declaration (``FIELDS``) before anything
uses one: an integer is ASCII decimal digits within its bounds (a 400-digit ``tokens`` is a
rejection here, never an ``OverflowError`` in a later sum), a name matches its pattern, a
hash is hexadecimal of its length. A field that fails is ``Rejected`` with reason
``bad_metadata`` and a message naming the field, so the master quarantines the file with
one log line and the round goes on without it (docs/distributed.md, "Security model").

The bounds are far above anything honest and small enough that all later arithmetic is
exact and bounded: step numbers below ``MAX_STEP``, counts (tokens, samples, elements)
below ``MAX_COUNT`` = 2**53, where a float64 still counts exactly. Fields this version does
not know are left alone (they are covered by the signature and never used); the header's
total size is bounded by ``wire.MAX_HEADER_BYTES``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "FIELDS",
    "FRAGMENT_PATTERN",
    "MAX_COUNT",
    "MAX_STEP",
    "NODE_ID_PATTERN",
    "FieldError",
    "Fields",
    "IntField",
    "TextField",
    "check_integer",
    "parse_fields",
]

MAX_STEP = 10**12
"""The largest step number (a node's local step, an outer step) a hub file may carry: a
step a microsecond for eleven days, or a step a second for 30,000 years."""

MAX_COUNT = 2**53
"""The largest token, sample or element count a hub file may carry: exact in a float64, so
weights computed from counts never overflow or round."""

NODE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""A node id: a letter or digit, then up to 63 letters, digits, ``.``, ``_`` or ``-``."""

FRAGMENT_PATTERN = re.compile(r"^(\d{1,4})/(\d{1,4})$", re.ASCII)
"""A streaming fragment field: ``"p/P"`` (``p < P`` is checked against the model)."""

_DIGITS = re.compile(r"^-?[0-9]+$")
_MAX_DIGITS = 20
_SHOWN = 40


class FieldError(ValueError):
    """A field value that does not fit its declaration (``parse_fields`` turns it into a
    ``Rejected``; this module cannot import ``wire``, which imports it)."""


def _shown(value: str) -> str:
    """``value`` for a message: at most ``_SHOWN`` characters, with its length if cut."""
    if len(value) <= _SHOWN:
        return repr(value)
    return f"{value[:_SHOWN]!r}... ({len(value)} characters)"


@dataclass(frozen=True)
class IntField:
    """A decimal integer in ``[minimum, maximum]`` (ASCII digits, an optional ``-``)."""

    minimum: int
    maximum: int
    doc: str

    def parse(self, value: str) -> int:
        if not _DIGITS.match(value):
            raise FieldError(f"is not a decimal integer: {_shown(value)}")
        digits = len(value.lstrip("-"))
        if digits > _MAX_DIGITS:  # never handed to int(): bounded work, whatever the length
            raise FieldError(f"is outside [{self.minimum}, {self.maximum}]: {digits} digits")
        number = int(value)
        if not self.minimum <= number <= self.maximum:
            raise FieldError(f"{number} is outside [{self.minimum}, {self.maximum}]")
        return number


@dataclass(frozen=True)
class TextField:
    """A string of at most ``max_length`` characters matching ``pattern`` -- or, with
    ``items``, a comma-separated list whose every item matches ``pattern`` (checked item by
    item: linear, where one pattern for the whole list could backtrack)."""

    pattern: re.Pattern[str]
    max_length: int
    doc: str
    items: bool = False

    def parse(self, value: str) -> str:
        if len(value) > self.max_length:
            raise FieldError(f"is longer than {self.max_length} characters ({len(value)})")
        parts = (value.split(",") if value else []) if self.items else [value]
        if not all(self.pattern.match(part) for part in parts):
            raise FieldError(f"is not {self.doc}: {_shown(value)}")
        return value


Field = IntField | TextField


def _text(pattern: str, max_length: int, doc: str) -> TextField:
    return TextField(re.compile(pattern, re.ASCII), max_length, doc)


_HEX64 = _text(r"^[0-9a-f]{64}$", 64, "a sha256 in lowercase hex")
_STEP = IntField(0, MAX_STEP, "a step number")
_COUNT = IntField(0, MAX_COUNT, "a count")
_WORD = _text(r"^[A-Za-z0-9_.:/+-]*$", 64, "a short name (letters, digits, _.:/+-)")

FIELDS: Mapping[str, Field] = {
    # every tensor file (``wire.encode_file``)
    "format": _WORD,
    "kind": _text(r"^(delta|global|outer)$", 6, "delta, global or outer"),
    "fingerprint": _text(r"^[A-Za-z0-9_.:-]{1,128}$", 128, "a model fingerprint"),
    "numel": _COUNT,
    "sha256": _HEX64,
    "signature": _HEX64,
    # deltas (``wire.encode_wire``)
    "node_id": TextField(NODE_ID_PATTERN, 64, "a node id (letters, digits, '.', '_', '-')"),
    "incarnation": _text(r"^[A-Za-z0-9_.-]*$", 64, "an incarnation id"),
    "local_step": _STEP,
    "first_step": _STEP,
    "base_outer_step": IntField(-1, MAX_STEP, "an outer step (-1: none)"),
    "encoding": _text(r"^[A-Za-z0-9_.-]{1,32}$", 32, "an encoding name"),
    "tokens": _COUNT,
    "samples": _COUNT,
    "block_size": _COUNT,
    "values": _COUNT,
    "fragment": TextField(FRAGMENT_PATTERN, 9, "a fragment 'p/P'"),
    # global and outer files, and the pointer
    "outer_step": _STEP,
    "ledger": _text(r"^\{.*\}$", 64 * 1024 * 1024, "a JSON object"),
    # the pointer (``pointer.Pointer.fields``)
    "algorithm": _WORD,
    "optimizer": _WORD,
    "model_file": _text(r"^global/model_\d{8,13}\.safetensors$", 64, "a global model file"),
    "outer_file": _text(r"^global/outer_\d{8,13}\.safetensors$", 64, "an outer state file"),
    "model_sha256": _HEX64,
    "outer_sha256": _HEX64,
    "master": TextField(NODE_ID_PATTERN, 64, "a node id (letters, digits, '.', '_', '-')"),
    "updated_at": _text(r"^[0-9A-Za-z:.+-]*$", 64, "a timestamp"),
    "applied": TextField(
        re.compile(r"^[0-9a-f]{16,64}$"), 16 * 1024 * 1024, "comma-separated hashes", items=True
    ),
    "progress": _text(r"^\{.*\}$", 16 * 1024 * 1024, "a JSON object"),
    "covered": _text(r"^\{.*\}$", 16 * 1024 * 1024, "a JSON object"),
}
"""Every metadata field a hub file of this version may carry, with its type and bounds."""


def check_integer(value: object, field: str) -> int:
    """``value`` (from parsed JSON: a ledger, a pointer's progress) as the integer ``field``
    declares; ``FieldError`` for anything else (a bool, a float, out of bounds)."""
    spec = FIELDS[field]
    assert isinstance(spec, IntField)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FieldError(f"{field} {value!r:.40} is not an integer")
    if not spec.minimum <= value <= spec.maximum:
        raise FieldError(f"{field} {value} is outside [{spec.minimum}, {spec.maximum}]")
    return value


@dataclass(frozen=True)
class Fields:
    """A file's metadata after ``parse_fields``: typed values of the declared fields."""

    values: Mapping[str, int | str]
    what: str

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def integer(self, name: str, default: int | None = None) -> int:
        """The integer field ``name``; ``default`` when it is absent (``KeyError`` when
        there is none: ``parse_fields`` was told which fields are required)."""
        value = self.values.get(name, default)
        if value is None:
            raise KeyError(f"{self.what} has no field {name!r}")
        assert isinstance(value, int), name  # declared as an IntField
        return value

    def text(self, name: str, default: str | None = None) -> str:
        value = self.values.get(name, default)
        if value is None:
            raise KeyError(f"{self.what} has no field {name!r}")
        assert isinstance(value, str), name  # declared as a TextField
        return value


def parse_fields(metadata: Mapping[str, str], what: str, required: Iterable[str] = ()) -> Fields:
    """Check every declared field of ``metadata`` (and that ``required`` ones are there);
    ``FieldError`` naming the first field that fails. Linear in the metadata's size."""
    missing = [name for name in required if name not in metadata]
    if missing:
        raise FieldError(f"{what} lacks metadata {missing}")
    values: dict[str, int | str] = {}
    for name, spec in FIELDS.items():
        raw = metadata.get(name)
        if raw is None:
            continue
        try:
            values[name] = spec.parse(raw)
        except FieldError as exc:
            raise FieldError(f"{what} field {name!r} {exc}") from None
    return Fields(values, what)
