"""Property-based fuzzing of the hub wire format (issue 12, "Fuzzing"): whatever bytes a
hub file holds, decoding yields a validated object or ``Rejected`` with a message -- never
another exception -- in bounded time. And (issue 22) whatever value a metadata field of a
validly signed file holds -- what a holder of the secret can write -- it parses to a value
of the field's type within its bounds (``diloco.fields``) or is ``Rejected``.
Derandomized, so CI runs the same examples."""

from __future__ import annotations

import functools
import json
import struct
import time
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic_callbacks.diloco.fields import (
    FIELDS,
    MAX_COUNT,
    MAX_STEP,
    FieldError,
    IntField,
    TextField,
    parse_fields,
)
from speedtronic_callbacks.diloco.legacy_hub import read_v2_pointer
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.pointer import Pointer, decode_pointer, encode_pointer
from speedtronic_callbacks.diloco.wire import (
    MAX_INCARNATIONS,
    Covered,
    DecodedDelta,
    DeltaInfo,
    Ledger,
    Progress,
    Rejected,
    decode_delta,
    decode_outer,
    encode_delta,
    encode_file,
    encode_outer,
    json_nesting_depth,
    parse_header,
    sign,
    to_wire,
)

SECRET = b"fuzz"
LAYOUT = build_layout(torch.nn.Linear(3, 2).state_dict())
FUZZ = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,  # timed below with a generous bound instead (shared CI machines)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SECONDS_PER_INPUT = 5.0


def _valid_delta() -> bytes:
    delta = {key: torch.full(LAYOUT.wire_shapes[key], 0.25) for key in LAYOUT.sync_keys}
    return encode_delta(delta, DeltaInfo("node-a", 10, 3, "inc"), LAYOUT, secret=SECRET)


VALID_DELTA = _valid_delta()
VALID_SHA = parse_header(VALID_DELTA).metadata["sha256"]
POINTER = Pointer(
    outer_step=3,
    model_file="global/model_00000003.safetensors",
    model_sha256="ab" * 32,
    outer_file="global/outer_00000003.safetensors",
    outer_sha256="cd" * 32,
    fingerprint=LAYOUT.fingerprint,
    master="master",
    updated_at="2026-01-01T00:00:00+00:00",
    applied=("ef" * 32,),
    progress={"node-a": ("inc", 10)},
    covered={"node-a": {"inc": {"": 10}}},
)
VALID_POINTER = encode_pointer(POINTER, secret=SECRET)


def outcome(decode: Callable[[], object]) -> object:
    """Run a decoder: its result, or the ``Rejected`` it raised (with a message); any other
    exception fails the test. Also checks the time bound."""
    started = time.monotonic()
    try:
        result: object = decode()
    except Rejected as exc:
        assert exc.detail and exc.reason.value
        result = exc
    assert time.monotonic() - started < SECONDS_PER_INPUT
    return result


def safetensors_file(header: bytes, payload: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + payload


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)

header_entries = st.dictionaries(
    st.sampled_from(["weight", "bias", "other", "__metadata__"]),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "X9"]),
            "shape": st.lists(st.integers(-2, 2**40), max_size=3),
            "data_offsets": st.lists(st.integers(-1, 64), min_size=0, max_size=3),
        }
    )
    | json_values,
    max_size=4,
)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_decode_to_a_delta_or_a_rejection(data: bytes) -> None:
    outcome(lambda: decode_delta(data, LAYOUT, secret=SECRET))
    outcome(lambda: decode_delta(data, LAYOUT, secret=None))


@FUZZ
@given(json_values | header_entries, st.binary(max_size=64))
def test_any_json_header_decodes_or_is_rejected(header: object, payload: bytes) -> None:
    data = safetensors_file(json.dumps(header).encode(), payload)
    outcome(lambda: parse_header(data))
    outcome(lambda: decode_delta(data, LAYOUT, secret=None))


@FUZZ
@given(st.integers(0, len(VALID_DELTA) - 1), st.integers(0, 255), st.integers(0, len(VALID_DELTA)))
def test_a_damaged_signed_delta_is_rejected_or_intact(position: int, byte: int, cut: int) -> None:
    flipped = bytearray(VALID_DELTA)
    flipped[position] = byte
    for data in (bytes(flipped), VALID_DELTA[:cut], VALID_DELTA + bytes(flipped[: cut % 17])):
        result = outcome(functools.partial(decode_delta, data, LAYOUT, secret=SECRET))
        if not isinstance(result, Rejected):
            assert getattr(result, "sha256", None) == VALID_SHA  # only harmless changes pass


@FUZZ
@given(st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_pointer_bytes_decode_or_are_rejected(data: bytes) -> None:
    outcome(lambda: decode_pointer(data, fingerprint=LAYOUT.fingerprint, secret=SECRET))
    outcome(lambda: decode_pointer(data, fingerprint=LAYOUT.fingerprint, secret=None))
    outcome(lambda: read_v2_pointer(data))  # a 2.0 pointer: None, V2Pointer or Rejected


@FUZZ
@given(st.integers(0, len(VALID_POINTER) - 1), st.integers(0, 255))
def test_a_damaged_signed_pointer_is_rejected_or_unchanged(position: int, byte: int) -> None:
    original = decode_pointer(VALID_POINTER, fingerprint=LAYOUT.fingerprint, secret=SECRET)
    damaged = bytearray(VALID_POINTER)
    damaged[position] = byte
    result = outcome(
        lambda: decode_pointer(bytes(damaged), fingerprint=LAYOUT.fingerprint, secret=SECRET)
    )
    assert isinstance(result, Rejected) or result == original


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.integers(1, 200_000), st.sampled_from(["[", '{"a":']), st.booleans())
def test_deep_nesting_is_a_rejection_not_a_recursion_error(
    depth: int, opener: str, closed: bool
) -> None:
    closer = "]" if opener == "[" else "}"
    text = (opener * depth + ("1" + closer * depth if closed else "")).encode()
    for data in (safetensors_file(text, b""), text):
        result = outcome(functools.partial(decode_pointer, data, fingerprint="x", secret=None))
        assert isinstance(result, Rejected)
        assert isinstance(outcome(functools.partial(parse_header, data)), Rejected)


@FUZZ
@given(json_values)
def test_the_nesting_depth_matches_the_structure(value: object) -> None:
    def depth(item: object) -> int:
        if isinstance(item, list):
            return 1 + max((depth(x) for x in item), default=0)
        if isinstance(item, dict):
            return 1 + max((depth(x) for x in item.values()), default=0)
        return 0

    assert json_nesting_depth(json.dumps(value).encode()) == depth(value)


# -- issue 22: every metadata field of a validly signed file ---------------------------------

field_values = (
    st.text(max_size=40)
    | st.from_regex(r"-?[0-9]{0,30}", fullmatch=True)
    | st.integers(-(2**80), 2**80).map(str)
    | st.sampled_from(["9" * 400, "9" * 5000, "\u0663", "\u00b2", "1_0", " 1", "1e3", "0x10"])
    | st.sampled_from(["0/2", "1/1", "3/2", "\u0663/\u0664", "a" * 65, "ab" * 32, "{}"])
)
"""Strings a key holder could put in any field: text, digits of any length, numbers far
out of bounds, characters that Python's int() or str.isdigit() would take."""


node_ids = (
    st.sampled_from(["node-a", "w_2.b"])
    | st.sampled_from(["node-a", "inc-1"])
    | st.sampled_from(["../x", "a" * 65, ""])
    | st.text(max_size=12)
)
steps = st.integers(0, 100) | st.integers(-(2**70), 2**70) | json_values
progress_json = st.dictionaries(
    node_ids,
    st.fixed_dictionaries({"incarnation": node_ids | json_values, "step": steps}),
    max_size=3,
)
covered_json = st.dictionaries(
    node_ids,
    st.dictionaries(
        node_ids,
        st.dictionaries(st.sampled_from(["", "0/2", "1/2", "9/2", "x"]), steps, max_size=3),
        max_size=6,
    ),
    max_size=3,
)
ledgers = json_values | st.fixed_dictionaries(
    {
        "applied": st.lists(st.sampled_from(["ab" * 32, "ab" * 8]), max_size=3)
        | st.lists(st.sampled_from(["ab" * 32, "x", ""]) | json_values, max_size=3),
        "progress": progress_json,
        "covered": covered_json,
    }
)
"""Ledgers as JSON: arbitrary values, and the ledger's own shape with arbitrary parts."""


def assert_within_bounds(name: str, value: int | str) -> None:
    spec = FIELDS[name]
    if isinstance(spec, IntField):
        assert isinstance(value, int) and spec.minimum <= value <= spec.maximum, (name, value)
    else:
        assert isinstance(spec, TextField) and isinstance(value, str)
        parts = (value.split(",") if value else []) if spec.items else [value]
        assert len(value) <= spec.max_length, (name, value)
        assert all(spec.pattern.match(part) for part in parts), (name, value)


@FUZZ
@given(st.sampled_from(sorted(FIELDS)), field_values)
def test_any_field_value_parses_to_its_bounded_type_or_is_a_field_error(
    name: str, value: str
) -> None:
    started = time.monotonic()
    try:
        fields = parse_fields({name: value}, "file")
    except FieldError as exc:
        assert name in str(exc)
    else:
        assert_within_bounds(name, fields.values[name])
    assert time.monotonic() - started < SECONDS_PER_INPUT


DELTA_FIELDS = {
    "node_id": "node-a",
    "local_step": "10",
    "first_step": "5",
    "base_outer_step": "3",
    "incarnation": "inc",
    "encoding": "fp32",
    "tokens": "640",
    "samples": "40",
}
WIRE = to_wire({key: torch.full(LAYOUT.wire_shapes[key], 0.25) for key in LAYOUT.sync_keys}, LAYOUT)


@FUZZ
@given(st.sampled_from([*sorted(FIELDS), "fragment", "unknown"]), field_values)
def test_a_signed_delta_with_any_field_value_decodes_bounded_or_is_rejected(
    name: str, value: str
) -> None:
    fields = {**DELTA_FIELDS, name: value}
    data = encode_file("delta", WIRE, fields, fingerprint=LAYOUT.fingerprint, secret=SECRET)
    result = outcome(lambda: decode_delta(data, LAYOUT, secret=SECRET))
    if isinstance(result, Rejected):
        return
    assert isinstance(result, DecodedDelta)
    info = result.info
    assert 0 <= info.local_step <= MAX_STEP and -1 <= info.base_outer_step <= MAX_STEP
    assert 0 <= info.tokens <= MAX_COUNT and 0 <= info.samples <= MAX_COUNT
    assert info.first_step is None or 0 <= info.first_step < info.local_step
    assert_within_bounds("node_id", info.node_id)
    assert_within_bounds("incarnation", info.incarnation)


POINTER_FIELDS = POINTER.fields()


def assert_progress_within_bounds(progress: Progress, covered: Covered) -> None:
    """A pointer's or ledger's per-node records: checked ids, bounded steps."""
    for node, (incarnation, step) in progress.items():
        assert_within_bounds("node_id", node)
        assert_within_bounds("incarnation", incarnation)
        assert 0 <= step <= MAX_STEP
    for node, lives in covered.items():
        assert_within_bounds("node_id", node)
        assert 0 < len(lives) <= MAX_INCARNATIONS
        for incarnation, steps in lives.items():
            assert_within_bounds("incarnation", incarnation)
            assert all(0 <= step <= MAX_STEP for step in steps.values())


@FUZZ
@given(
    st.sampled_from(sorted(POINTER_FIELDS)),
    field_values | json_values.map(json.dumps) | (progress_json | covered_json).map(json.dumps),
)
def test_a_signed_pointer_with_any_field_value_decodes_bounded_or_is_rejected(
    name: str, value: str
) -> None:
    fields = {**POINTER_FIELDS, name: value}
    fields["signature"] = sign(fields, SECRET)
    data = json.dumps(fields).encode()
    result = outcome(lambda: decode_pointer(data, fingerprint=LAYOUT.fingerprint, secret=SECRET))
    if isinstance(result, Rejected):
        return
    assert isinstance(result, Pointer) and 0 <= result.outer_step <= MAX_STEP
    assert_progress_within_bounds(result.progress, result.covered)


@FUZZ
@given(ledgers)
def test_a_signed_outer_file_with_any_ledger_decodes_bounded_or_is_rejected(
    ledger: object,
) -> None:
    good = encode_outer({}, Ledger(), 3, LAYOUT, secret=SECRET)
    meta = dict(parse_header(good).metadata)
    meta["ledger"] = json.dumps(ledger)
    fields = {key: value for key, value in meta.items() if key not in ("signature", "numel")}
    fields.pop("sha256")
    data = encode_file("outer", {}, fields, fingerprint=LAYOUT.fingerprint, secret=SECRET)
    result = outcome(lambda: decode_outer(data, LAYOUT, secret=SECRET, outer_step=3))
    if isinstance(result, Rejected):
        return
    assert isinstance(result, tuple)
    assert_progress_within_bounds(result[1].progress, result[1].covered)
