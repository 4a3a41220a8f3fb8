"""DiLoCo arithmetic and file formats: pseudo-gradient sign, averaging, staleness
weighting, the Nesterov outer step, and strict validation of exchanged files."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from speedtronic_callbacks.diloco.math import (
    DeltaMismatchError,
    NesterovOuterOptimizer,
    aggregate_deltas,
    average_deltas,
    pseudo_gradient,
    staleness_weight,
)
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.pointer import (
    Pointer,
    decode_pointer,
    encode_pointer,
    model_file_name,
    outer_file_name,
)
from speedtronic_callbacks.diloco.wire import (
    Compression,
    DeltaInfo,
    Ledger,
    Rejected,
    RejectionReason,
    decode_delta,
    decode_global,
    decode_outer,
    encode_delta,
    encode_global,
    encode_outer,
    expand_aliases,
    parse_header,
)

INFO = DeltaInfo(node_id="node-a", local_step=10, base_outer_step=2, incarnation="abc")


def test_pseudo_gradient_is_baseline_minus_current_in_fp32() -> None:
    baseline = {"w": torch.tensor([3.0, 5.0]), "count": torch.tensor(7)}
    current = {"w": torch.tensor([1.0, 4.0]), "count": torch.tensor(9)}

    delta = pseudo_gradient(baseline, current)

    assert set(delta) == {"w"}  # integer buffers are not exchanged
    assert delta["w"].dtype == torch.float32
    assert torch.equal(delta["w"], torch.tensor([2.0, 1.0]))


def test_pseudo_gradient_of_bf16_weights_is_fp32() -> None:
    baseline = {"w": torch.tensor([1.5], dtype=torch.bfloat16)}
    current = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    assert pseudo_gradient(baseline, current)["w"].dtype == torch.float32


def test_pseudo_gradient_names_missing_and_misshaped_keys() -> None:
    with pytest.raises(DeltaMismatchError, match="missing \\['b'\\]"):
        pseudo_gradient({"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": torch.zeros(2)})
    with pytest.raises(DeltaMismatchError, match="shape mismatch for 'a'"):
        pseudo_gradient({"a": torch.zeros(2)}, {"a": torch.zeros(3)})


def test_complex_entries_keep_their_imaginary_part() -> None:
    baseline = {"z": torch.tensor([1 + 2j], dtype=torch.complex64)}
    current = {"z": torch.tensor([0 + 0j], dtype=torch.complex64)}
    delta = pseudo_gradient(baseline, current)
    assert torch.equal(delta["z"], torch.tensor([[1.0, 2.0]]))

    params = {"z": torch.tensor([1 + 2j], dtype=torch.complex64)}
    NesterovOuterOptimizer(lr=1.0, momentum=0.0).step(params, delta)
    assert torch.equal(params["z"], torch.tensor([0 + 0j], dtype=torch.complex64))


def test_average_is_the_elementwise_mean() -> None:
    mean = average_deltas([{"w": torch.tensor([2.0, 1.0])}, {"w": torch.tensor([0.0, 3.0])}])
    assert torch.equal(mean["w"], torch.tensor([1.0, 2.0]))


def test_average_rejects_empty_and_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="empty"):
        average_deltas([])
    with pytest.raises(DeltaMismatchError):
        average_deltas([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}])


def test_staleness_weight_is_polynomial_and_can_be_disabled() -> None:
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(3, 0.5) == pytest.approx(0.5)
    assert staleness_weight(7, 0.0) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1, 0.5)


def test_stale_deltas_count_less_and_divide_by_the_count() -> None:
    fresh = {"w": torch.tensor([4.0])}
    stale = {"w": torch.tensor([4.0])}
    weights = [staleness_weight(0, 0.5), staleness_weight(3, 0.5)]
    result = aggregate_deltas([fresh, stale], weights)
    assert torch.allclose(result["w"], torch.tensor([(4.0 + 2.0) / 2]))


def test_nesterov_first_update_is_one_point_nine_g() -> None:
    params = {"w": torch.tensor([1.0, 1.0])}
    optimizer = NesterovOuterOptimizer(lr=0.1, momentum=0.9)

    optimizer.step(params, {"w": torch.tensor([1.0, 2.0])})

    assert torch.allclose(params["w"], torch.tensor([0.81, 0.62]))
    optimizer.step(params, {"w": torch.tensor([1.0, 2.0])})
    assert params["w"].shape == (2,)


def test_nesterov_defaults_and_lr_one_reproduces_the_node() -> None:
    optimizer = NesterovOuterOptimizer()
    assert (optimizer.lr, optimizer.momentum) == (0.7, 0.9)
    global_state = {"w": torch.tensor([3.0, 5.0])}
    node_current = {"w": torch.tensor([1.0, 4.0])}
    delta = pseudo_gradient(global_state, node_current)
    NesterovOuterOptimizer(lr=1.0, momentum=0.0).step(global_state, delta)
    assert torch.equal(global_state["w"], node_current["w"])


def test_nesterov_state_round_trips_and_validates() -> None:
    first = NesterovOuterOptimizer(lr=0.5, momentum=0.5)
    params = {"w": torch.zeros(2)}
    first.step(params, {"w": torch.ones(2)})
    second = NesterovOuterOptimizer(lr=0.5, momentum=0.5)
    second.load_state_dict(first.state_dict())
    a, b = {"w": torch.zeros(2)}, {"w": torch.zeros(2)}
    first.step(a, {"w": torch.ones(2)})
    second.step(b, {"w": torch.ones(2)})
    assert torch.equal(a["w"], b["w"])
    with pytest.raises(KeyError):
        first.step(params, {"missing": torch.ones(2)})
    with pytest.raises(DeltaMismatchError):
        first.step(params, {"w": torch.ones(3)})
    with pytest.raises(ValueError):
        NesterovOuterOptimizer(momentum=1.0)


# -- files ------------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(3)
        self.register_buffer("steps", torch.tensor(4))


def test_layout_sends_tied_weights_once_and_carries_integer_buffers() -> None:
    model = Tied()
    layout = build_layout(model.state_dict())
    assert layout.aliases == {"head.weight": "embed.weight"}
    assert "head.weight" not in layout.sync_keys
    assert layout.carried_keys == ("steps",)
    assert layout.sync_numel == 15 + 3 + 3


def test_fingerprint_changes_with_structure_and_config() -> None:
    base = build_layout(Tied().state_dict()).fingerprint
    assert build_layout(Tied().state_dict()).fingerprint == base
    assert build_layout(Tied().state_dict(), "lr=2").fingerprint != base
    assert build_layout(nn.Linear(3, 5).state_dict()).fingerprint != base


def test_delta_round_trip_carries_metadata() -> None:
    model = Tied()
    layout = build_layout(model.state_dict())
    delta = {key: torch.randn(layout.wire_shapes[key]) for key in layout.sync_keys}

    data = encode_delta(delta, INFO, layout)
    decoded = decode_delta(data, layout, secret=None)

    assert decoded.info == INFO
    for key in layout.sync_keys:
        assert torch.equal(decoded.tensors[key], delta[key])
    meta = parse_header(data).metadata
    assert meta["numel"] == str(layout.sync_numel)
    assert meta["sha256"] == decoded.sha256
    assert meta["fingerprint"] == layout.fingerprint


@pytest.mark.parametrize("compression", [Compression.BF16, Compression.FP16])
def test_compressed_delta_is_about_half_the_bytes(compression: Compression) -> None:
    layout = build_layout(nn.Linear(64, 64).state_dict())
    delta = {key: torch.randn(layout.wire_shapes[key]) for key in layout.sync_keys}
    full = encode_delta(delta, INFO, layout)
    half = encode_delta(delta, INFO, layout, compression=compression)
    payload = layout.sync_numel * 4
    header_full = len(full) - payload
    assert len(half) - header_full == pytest.approx(payload / 2, rel=0.01)
    decoded = decode_delta(half, layout, secret=None)
    assert decoded.tensors["weight"].dtype == torch.float32
    assert torch.allclose(decoded.tensors["weight"], delta["weight"], rtol=1e-2, atol=1e-2)


def test_fp16_falls_back_to_fp32_instead_of_overflowing() -> None:
    layout = build_layout(nn.Linear(2, 2).state_dict())
    delta = {key: torch.full(layout.wire_shapes[key], 1e6) for key in layout.sync_keys}
    data = encode_delta(delta, INFO, layout, compression=Compression.FP16)
    decoded = decode_delta(data, layout, secret=None)
    assert torch.equal(decoded.tensors["weight"], delta["weight"])


def _reason(action: Callable[[], object]) -> RejectionReason:
    with pytest.raises(Rejected) as info:
        action()
    return info.value.reason


def test_decode_rejects_bad_files_with_typed_reasons() -> None:
    layout = build_layout(nn.Linear(3, 2).state_dict())
    good = {key: torch.ones(layout.wire_shapes[key]) for key in layout.sync_keys}
    other_layout = build_layout(nn.Linear(3, 2).state_dict(), "other config")
    wrong_keys = build_layout(nn.Linear(3, 2, bias=False).state_dict())
    nan = {key: value.clone() for key, value in good.items()}
    nan["weight"][0, 0] = float("nan")
    data = encode_delta(good, INFO, layout)

    def decode(blob: bytes, secret: bytes | None = None) -> Callable[[], object]:
        return lambda: decode_delta(blob, layout, secret=secret)

    assert _reason(decode(b"not safetensors")) is RejectionReason.CORRUPT
    assert _reason(decode(data[: len(data) // 2])) is RejectionReason.CORRUPT
    assert (
        _reason(decode(encode_delta(good, INFO, other_layout)))
        is RejectionReason.FOREIGN_FINGERPRINT
    )
    mismatched = encode_delta({"weight": good["weight"]}, INFO, wrong_keys).replace(
        wrong_keys.fingerprint.encode(), layout.fingerprint.encode()
    )
    assert _reason(decode(mismatched)) is RejectionReason.WRONG_KEYS
    assert _reason(decode(encode_delta(nan, INFO, layout))) is RejectionReason.NON_FINITE
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # one payload byte: the header hash no longer matches
    assert _reason(decode(bytes(flipped))) is RejectionReason.BAD_HASH


def test_wrong_shapes_are_rejected() -> None:
    layout = build_layout(nn.Linear(3, 2).state_dict())
    other = build_layout(nn.Linear(4, 2).state_dict())
    blob = encode_delta(
        {key: torch.ones(other.wire_shapes[key]) for key in other.sync_keys}, INFO, other
    ).replace(other.fingerprint.encode(), layout.fingerprint.encode())
    assert _reason(lambda: decode_delta(blob, layout, secret=None)) is RejectionReason.WRONG_SHAPES


def test_signatures_bind_content_and_need_the_right_key() -> None:
    layout = build_layout(nn.Linear(3, 2).state_dict())
    delta = {key: torch.ones(layout.wire_shapes[key]) for key in layout.sync_keys}
    signed = encode_delta(delta, INFO, layout, secret=b"right")
    assert decode_delta(signed, layout, secret=b"right").info == INFO
    assert decode_delta(signed, layout, secret=None).info == INFO  # verification is opt-in
    wrong = encode_delta(delta, INFO, layout, secret=b"wrong")
    unsigned = encode_delta(delta, INFO, layout)

    def check(blob: bytes) -> Callable[[], object]:
        return lambda: decode_delta(blob, layout, secret=b"right")

    assert _reason(check(wrong)) is RejectionReason.BAD_SIGNATURE
    assert _reason(check(unsigned)) is RejectionReason.UNSIGNED
    forged = signed.replace(b'"base_outer_step":"2"', b'"base_outer_step":"9"')
    assert _reason(check(forged)) is RejectionReason.BAD_SIGNATURE


def test_global_file_round_trip_with_tied_weights() -> None:
    model = Tied()
    layout = build_layout(model.state_dict())
    state = {key: value.clone() for key, value in model.state_dict().items()}
    data = encode_global(state, 3, layout, secret=None)
    decoded = decode_global(data, layout, secret=None, outer_step=3)
    assert "head.weight" not in decoded
    restored = Tied()
    restored.load_state_dict(expand_aliases(decoded, layout), strict=True)
    assert torch.equal(restored.head.weight, model.embed.weight)
    assert int(restored.state_dict()["steps"]) == 4
    assert _reason(lambda: decode_global(data, layout, secret=None, outer_step=4)) is (
        RejectionReason.BAD_METADATA
    )


def test_outer_state_and_pointer_round_trip() -> None:
    layout = build_layout(nn.Linear(3, 2).state_dict())
    momentum = {"weight": torch.ones(2, 3)}
    ledger = Ledger(
        applied={"a" * 64},
        progress={"node-a": ("inc", 40)},
        covered={"node-a": {"inc": {"0/2": 40, "1/2": 38}, "old": {"": 7}}},
    )
    data = encode_outer(momentum, ledger, 5, layout, secret=b"k")
    restored, restored_ledger = decode_outer(data, layout, secret=b"k", outer_step=5)
    assert torch.equal(restored["weight"], momentum["weight"])
    assert restored_ledger == ledger

    pointer = Pointer(
        outer_step=5,
        model_file=model_file_name(5),
        model_sha256="ab" * 32,
        outer_file=outer_file_name(5),
        outer_sha256="cd" * 32,
        fingerprint=layout.fingerprint,
        master="boss",
        updated_at="now",
        applied=("e" * 64, "f" * 64),
        progress={"node-a": ("inc", 40)},
        covered={"node-a": {"inc": {"": 40}}},
    )
    blob = encode_pointer(pointer, secret=b"k")
    assert decode_pointer(blob, fingerprint=layout.fingerprint, secret=b"k") == pointer
    assert (
        _reason(lambda: decode_pointer(blob, fingerprint=layout.fingerprint, secret=b"other"))
        is RejectionReason.BAD_SIGNATURE
    )
    hijacked = encode_pointer(
        Pointer(
            5,
            "nodes/x/evil.safetensors",
            "ab" * 32,
            outer_file_name(5),
            "cd" * 32,
            layout.fingerprint,
            "boss",
            "now",
        ),
        secret=None,
    )
    assert (
        _reason(lambda: decode_pointer(hijacked, fingerprint=layout.fingerprint, secret=None))
        is RejectionReason.BAD_METADATA
    )
