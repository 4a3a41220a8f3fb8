"""Property-based fuzzing of the hub wire format (issue 12, "Fuzzing"): whatever bytes a
hub file holds, decoding yields a validated object or ``Rejected`` with a message -- never
another exception -- in bounded time. Derandomized, so CI runs the same examples."""

from __future__ import annotations

import functools
import json
import struct
import time
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.pointer import Pointer, decode_pointer, encode_pointer
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Rejected,
    decode_delta,
    encode_delta,
    json_nesting_depth,
    parse_header,
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
VALID_POINTER = encode_pointer(
    Pointer(
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
    ),
    secret=SECRET,
)


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
