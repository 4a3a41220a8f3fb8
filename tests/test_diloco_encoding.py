"""The ``delta_dtype`` codecs (``diloco.encoding``): error bounds, sizes, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from speedtronic_callbacks.diloco.encoding import (
    BLOCK_SIZE,
    E2M1_VALUES,
    Encoding,
    Packed,
    PackingError,
    bytes_per_value,
    pack,
    packed_bytes,
    round_trip,
    unpack,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Rejected,
    RejectionReason,
    decode_delta,
    encode_delta,
    encode_file,
    flatten_delta,
    parse_header,
    to_wire,
    unflatten_delta,
)

torch.set_num_threads(1)

_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)
_vectors = st.lists(_finite, min_size=0, max_size=300)
_SLACK = 1e-6  # float32 rounding of the scale and the product


def _blockwise_peak(values: torch.Tensor) -> torch.Tensor:
    """Each value's block maximum magnitude."""
    blocks = -(-values.numel() // BLOCK_SIZE)
    padded = torch.zeros(blocks * BLOCK_SIZE)
    padded[: values.numel()] = values.abs()
    return (
        padded.view(blocks, BLOCK_SIZE).amax(dim=1).repeat_interleave(BLOCK_SIZE)[: values.numel()]
    )


@settings(max_examples=60, deadline=None)
@given(_vectors)
def test_int8_round_trip_error_is_within_half_a_step(values: list[float]) -> None:
    flat = torch.tensor(values, dtype=torch.float32)
    back = round_trip(flat, Encoding.INT8)
    assert back.shape == flat.shape and back.dtype == torch.float32
    peak = _blockwise_peak(flat)
    assert bool(((back - flat).abs() <= peak / 254 * (1 + 1e-5) + _SLACK).all())


@settings(max_examples=60, deadline=None)
@given(_vectors)
def test_fp4_round_trip_error_is_within_the_e2m1_half_gap(values: list[float]) -> None:
    flat = torch.tensor(values, dtype=torch.float32)
    back = round_trip(flat, Encoding.FP4)
    peak = _blockwise_peak(flat)
    bound = torch.maximum(peak / 24, flat.abs() / 4) * (1 + 1e-5) + _SLACK
    assert bool(((back - flat).abs() <= bound).all())
    # Every decoded value is an e2m1 number times its block's scale, with the input's sign.
    assert bool((back * flat >= 0).all())


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([Encoding.INT8, Encoding.FP4]), st.integers(0, 1000))
def test_packed_sizes_are_exact(encoding: Encoding, numel: int) -> None:
    packed = pack(torch.linspace(-1, 1, numel), encoding)
    blocks = -(-numel // BLOCK_SIZE)
    codes = numel if encoding is Encoding.INT8 else (numel + 1) // 2
    assert (packed.codes.numel(), packed.scales.numel()) == (codes, blocks)
    assert packed.nbytes == packed_bytes(encoding, numel) == codes + 4 * blocks
    assert unpack(packed).numel() == numel


def test_fp4_with_its_scales_is_at_most_a_seventh_of_fp32() -> None:
    fp32 = bytes_per_value(Encoding.FP32)
    assert fp32 == 4
    assert bytes_per_value(Encoding.BF16) == 2
    assert bytes_per_value(Encoding.INT8) == 1 + 4 / 64
    assert bytes_per_value(Encoding.FP4) == 0.5 + 4 / 64
    assert bytes_per_value(Encoding.FP4) <= fp32 / 7
    for numel in (64 * 1000, 124_000_000 + 37):  # a small and a GPT-2-sized model
        assert packed_bytes(Encoding.FP4, numel) <= packed_bytes(Encoding.FP32, numel) / 7


def test_e2m1_grid_values_and_odd_counts_round_trip_exactly() -> None:
    grid = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES[1:])])  # 15 values: odd
    packed = pack(grid, Encoding.FP4)
    assert packed.codes.numel() == 8 and float(packed.scales[0]) == 1.0
    assert torch.equal(unpack(packed), grid)
    assert int(packed.codes[-1]) >> 4 == 0  # the pad nibble is zero
    ints = torch.arange(-127, 128, dtype=torch.float32)  # 255 values: odd
    ints[::BLOCK_SIZE] = 127.0  # every block's peak is 127: scale 1, exact
    assert torch.equal(round_trip(ints, Encoding.INT8), ints)


def test_zero_blocks_and_empty_vectors_decode_to_zeros() -> None:
    for encoding in (Encoding.INT8, Encoding.FP4):
        zeros = torch.zeros(130)
        packed = pack(zeros, encoding)
        assert bool((packed.scales == 0).all())
        assert torch.equal(unpack(packed), zeros)
        assert unpack(pack(torch.zeros(0), encoding)).numel() == 0


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(encoding: Encoding, bad: float) -> None:
    with pytest.raises(ValueError, match="NaN/Inf"):
        round_trip(torch.tensor([1.0, bad, 2.0]), encoding)


def _tampered(packed: Packed, **changes: object) -> Packed:
    fields = {
        "codec": packed.codec,
        "numel": packed.numel,
        "block_size": packed.block_size,
        "codes": packed.codes,
        "scales": packed.scales,
        **changes,
    }
    return Packed(**fields)  # type: ignore[arg-type]  # test builds a deliberately bad one


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.FP4])
def test_sizes_or_scales_that_do_not_fit_the_header_are_refused(encoding: Encoding) -> None:
    packed = pack(torch.randn(100, generator=torch.Generator().manual_seed(0)), encoding)
    with pytest.raises(PackingError, match="codes hold"):
        unpack(_tampered(packed, codes=packed.codes[:-1]))
    with pytest.raises(PackingError, match="codes hold"):
        unpack(_tampered(packed, numel=packed.numel + 2 * BLOCK_SIZE))
    with pytest.raises(PackingError, match="scales"):
        unpack(_tampered(packed, scales=packed.scales[:-1]))
    for junk in (-1.0, float("nan"), float("inf")):
        scales = packed.scales.clone()
        scales[0] = junk
        with pytest.raises(PackingError, match="finite and >= 0"):
            unpack(_tampered(packed, scales=scales))


def test_unknown_encodings_are_named() -> None:
    assert Encoding.parse("none") is Encoding.FP32
    assert Encoding.parse("fp4") is Encoding.FP4
    with pytest.raises(ValueError, match="unknown delta encoding 'fp3'.*int8"):
        Encoding.parse("fp3")


# -- delta files on the hub (wire) ------------------------------------------------------

INFO = DeltaInfo(node_id="node-a", local_step=10, base_outer_step=2, incarnation="abc")
SECRET = b"shared secret"


def _layout_and_delta() -> tuple[ModelLayout, dict[str, torch.Tensor]]:
    layout = build_layout(nn.Linear(33, 7).state_dict())  # 238 values: not whole blocks
    generator = torch.Generator().manual_seed(3)
    delta = {
        key: torch.randn(layout.wire_shapes[key], generator=generator) for key in layout.sync_keys
    }
    return layout, delta


@pytest.mark.parametrize("encoding", list(Encoding))
def test_every_encoding_travels_in_a_signed_delta_file(encoding: Encoding) -> None:
    layout, delta = _layout_and_delta()
    data = encode_delta(delta, INFO, layout, compression=encoding, secret=SECRET)
    meta = parse_header(data).metadata
    assert meta["encoding"] == encoding.value
    decoded = decode_delta(data, layout, secret=SECRET)
    assert decoded.encoding is encoding and decoded.info == INFO
    flat = flatten_delta(delta, layout)
    expected = unflatten_delta(round_trip(flat, encoding), layout)
    for key in layout.sync_keys:
        assert decoded.tensors[key].dtype == torch.float32
        assert torch.equal(decoded.tensors[key], expected[key])
    if encoding.packed:  # the file's payload is exactly the packed size
        header_length = int.from_bytes(data[:8], "little")
        assert len(data) - 8 - header_length == packed_bytes(encoding, layout.sync_numel)
        assert meta["values"] == str(layout.sync_numel) and meta["block_size"] == "64"


def test_a_delta_file_of_an_earlier_version_without_an_encoding_still_decodes() -> None:
    layout, delta = _layout_and_delta()
    wire = to_wire(delta, layout, Encoding.BF16)
    fields = {"node_id": "node-a", "local_step": "10", "base_outer_step": "2"}
    data = encode_file("delta", wire, fields, fingerprint=layout.fingerprint, secret=None)
    decoded = decode_delta(data, layout, secret=None)
    assert decoded.encoding is Encoding.BF16 and (decoded.info.tokens, decoded.info.samples) == (
        0,
        0,
    )
    assert torch.equal(decoded.tensors["weight"], wire["weight"].float())


def _reason(data: bytes, layout: ModelLayout, secret: bytes | None = SECRET) -> RejectionReason:
    with pytest.raises(Rejected) as info:
        decode_delta(data, layout, secret=secret)
    return info.value.reason


def _packed_file(
    layout: ModelLayout,
    wire: dict[str, torch.Tensor],
    secret: bytes | None = SECRET,
    **fields: str,
) -> bytes:
    base = {
        "node_id": "node-a",
        "local_step": "10",
        "base_outer_step": "2",
        "encoding": "fp4",
        "block_size": "64",
        "values": str(layout.sync_numel),
        **fields,
    }
    return encode_file("delta", wire, base, fingerprint=layout.fingerprint, secret=secret)


def test_unknown_encodings_and_packed_sizes_that_disagree_with_the_header_are_rejected() -> None:
    layout, delta = _layout_and_delta()
    wire = to_wire(delta, layout, Encoding.FP4)
    decode_delta(_packed_file(layout, wire), layout, secret=SECRET)  # the honest file is fine
    assert (
        _reason(_packed_file(layout, wire, encoding="fp3"), layout)
        is RejectionReason.UNKNOWN_ENCODING
    )
    # An unknown encoding is only reported once the signature verified.
    unsigned = encode_file(
        "delta", wire, {"encoding": "fp3"}, fingerprint=layout.fingerprint, secret=None
    )
    assert _reason(unsigned, layout) is RejectionReason.UNSIGNED
    short = {"codes": wire["codes"][:-1], "scales": wire["scales"]}
    assert _reason(_packed_file(layout, short), layout) is RejectionReason.BAD_PACKING
    fewer_scales = {"codes": wire["codes"], "scales": wire["scales"][:-1]}
    assert _reason(_packed_file(layout, fewer_scales), layout) is RejectionReason.BAD_PACKING
    bigger = str(layout.sync_numel + 1)
    assert _reason(_packed_file(layout, wire, values=bigger), layout) is RejectionReason.BAD_PACKING
    assert (
        _reason(_packed_file(layout, wire, block_size="32"), layout) is RejectionReason.BAD_PACKING
    )
    assert (
        _reason(_packed_file(layout, wire, block_size="0"), layout) is RejectionReason.BAD_PACKING
    )
    assert (
        _reason(_packed_file(layout, wire, block_size="x"), layout) is RejectionReason.BAD_METADATA
    )
    negative = {"codes": wire["codes"], "scales": -wire["scales"] - 1}
    assert _reason(_packed_file(layout, negative), layout) is RejectionReason.BAD_PACKING
    extra = {**wire, "weight": delta["weight"]}
    assert _reason(_packed_file(layout, extra), layout) is RejectionReason.WRONG_KEYS
    as_floats = {"codes": wire["codes"].float(), "scales": wire["scales"]}
    assert _reason(_packed_file(layout, as_floats), layout) is RejectionReason.BAD_PACKING
    assert _reason(_packed_file(layout, wire, tokens="-5"), layout) is RejectionReason.BAD_METADATA


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["fp4", "int8", "fp3", ""]),
    st.sampled_from(["64", "1", "0", "-3", "1048577", "9" * 30]),
    st.integers(-3, 3),
    st.integers(0, 1),
    st.integers(-2, 2),
)
def test_any_packed_header_decodes_or_is_rejected(
    encoding: str, block_size: str, values_shift: int, codes_cut: int, scales_shift: int
) -> None:
    layout, delta = _layout_and_delta()
    wire = to_wire(delta, layout, Encoding.FP4)
    scales = wire["scales"]
    if scales_shift > 0:
        scales = torch.cat([scales, torch.ones(scales_shift)])
    elif scales_shift < 0:
        scales = scales[:scales_shift]
    tampered = {"codes": wire["codes"][: wire["codes"].numel() - codes_cut], "scales": scales}
    values = str(layout.sync_numel + values_shift)
    data = _packed_file(
        layout, tampered, None, encoding=encoding, block_size=block_size, values=values
    )
    try:
        decoded = decode_delta(data, layout, secret=None)
    except Rejected:
        return
    assert set(decoded.tensors) == set(layout.sync_keys)
    assert all(bool(torch.isfinite(t).all()) for t in decoded.tensors.values())
