"""The ``Codec`` interface and its registry (``diloco.codec``, ``diloco/codecs/``): one
class per codec, found by name; a codec registered from outside travels through a hub
round like a built-in; the earlier names resolve to the same codec objects."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, get_args

import pytest
import torch

from speedtronic import Trainer
from speedtronic_callbacks import diloco
from speedtronic_callbacks.diloco import codecs, wire
from speedtronic_callbacks.diloco.codec import BlockCodec, CastCodec, Codec
from speedtronic_callbacks.diloco.codecs import (
    BF16,
    FP4,
    FP16,
    FP32,
    INT8,
    CodecName,
    codec_named,
    register_codec,
    registered_codecs,
    unregister_codec,
)
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.encoding import Compression, Encoding, packed_bytes
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, delta_path
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.node import NodeSettings
from speedtronic_callbacks.diloco.options import DiLoCoOptions, delta_encoding
from speedtronic_callbacks.diloco.transport_base import RetryingTransport, RetryPolicy
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Rejected,
    RejectionReason,
    decode_delta,
    encode_delta,
    parse_header,
)

torch.set_num_threads(1)


class Int4Codec(BlockCodec):
    """A toy codec written the way a new one is: ``round(x / scale)`` in ``[-7, 7]``, two
    values per byte (offset by 8), one float32 scale ``max|x| / 7`` per block."""

    name: ClassVar[str] = "int4"
    top: ClassVar[float] = 7.0

    def code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def quantise(self, scaled: torch.Tensor) -> torch.Tensor:
        nibbles = (scaled.round().clamp_(-7, 7) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def dequantise(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:numel]
        return nibbles.to(torch.float32) - 8


@pytest.fixture
def int4() -> Iterator[Codec]:
    codec = register_codec(Int4Codec())
    try:
        yield codec
    finally:
        unregister_codec(codec.name)


def test_every_built_in_codec_is_one_registered_class() -> None:
    assert [codec.name for codec in registered_codecs()] == list(get_args(CodecName))
    assert [type(codec).__name__ for codec in registered_codecs()] == [
        "FP32Codec",
        "BF16Codec",
        "FP16Codec",
        "Int8Codec",
        "FP4Codec",
    ]
    assert all(isinstance(codec, CastCodec) for codec in (FP32, BF16, FP16))
    assert all(isinstance(codec, BlockCodec) for codec in (INT8, FP4))
    assert codec_named("none") is FP32 and codec_named("fp4") is FP4
    assert [codec.nbytes(64) for codec in registered_codecs()] == [256, 128, 128, 68, 36]
    assert not FP32.lossy and all(codec.lossy for codec in (BF16, FP16, INT8, FP4))
    with pytest.raises(ValueError, match="already registered"):
        register_codec(type(INT8)())
    with pytest.raises(ValueError, match="unknown delta encoding 'fp3'"):
        codec_named("fp3")


def test_the_earlier_names_are_the_same_codec_objects() -> None:
    """``Encoding`` (the enum), the ``Compression`` enum of ``wire`` and the ``diloco``
    package, and the option strings all resolve to the registered codecs."""
    assert (Encoding.FP32, Encoding.BF16, Encoding.FP16, Encoding.INT8, Encoding.FP4) == (
        FP32,
        BF16,
        FP16,
        INT8,
        FP4,
    )
    assert list(Encoding) == list(registered_codecs())
    assert Encoding("int8") is INT8 and Encoding.parse("none") is FP32
    assert Encoding.FP4.value == "fp4"
    assert wire.Compression is Compression is diloco.Compression
    assert (Compression.NONE, Compression.BF16, Compression.FP16) == (FP32, BF16, FP16)
    assert Compression("bf16") is BF16 and Compression("none") is FP32
    assert list(Compression) == [FP32, BF16, FP16]
    with pytest.raises(ValueError, match="not a valid Compression"):
        Compression("int8")
    assert Compression.BF16.dtype is torch.bfloat16
    assert delta_encoding(DiLoCoOptions(hub_dir="x", compression="fp16")) is FP16
    assert delta_encoding(DiLoCoOptions(hub_dir="x", delta_dtype="int8")) is INT8
    assert NodeSettings(node_id="n", role="worker", compression=BF16).encoding is BF16


def test_a_registered_codec_travels_in_a_delta_file_and_a_master_round(
    tmp_path: Path, int4: Codec
) -> None:
    MasterLoop._active.clear()
    state = {"weight": torch.full((4, 9), 0.5), "bias": torch.full((4,), 0.5)}  # 40 values
    layout = build_layout(state)
    policy = RetryPolicy(attempts=1, initial=0.001, maximum=0.001, timeout=10)
    transport = RetryingTransport(DirectoryTransport(tmp_path / "hub"), policy)
    plain = MasterSettings("master", outer_lr=1.0, outer_momentum=0.0, staleness_power=0.0)
    master = MasterLoop(transport, layout, plain)
    master.reconcile(state)
    delta = {key: torch.full(layout.wire_shapes[key], 0.2) for key in layout.sync_keys}
    delta["bias"][0] = -0.5
    info = DeltaInfo("node", 1, master.outer_step, "inc")
    data = encode_delta(delta, info, layout, compression=int4)
    meta = parse_header(data).metadata
    assert (meta["encoding"], meta["block_size"], meta["values"]) == ("int4", "64", "40")
    header_length = int.from_bytes(data[:8], "little")
    assert len(data) - 8 - header_length == packed_bytes(int4, layout.sync_numel) == 20 + 4
    decoded = decode_delta(data, layout, secret=None)
    assert decoded.encoding is int4
    transport.put(delta_path("node", 1, meta["sha256"]), data)
    report = master.sync_once()
    assert report.published and [item.node_id for item in report.applied] == ["node"]
    snapshot = master.snapshot()
    assert snapshot is not None
    new = snapshot.global_state
    # The block's peak is 0.5 (scale 0.5 / 7): 0.2 travels as 3 x scale, -0.5 exactly.
    step = 0.5 / 7
    assert torch.allclose(new["weight"], state["weight"] - 3 * step)
    assert float(new["bias"][0]) == pytest.approx(0.5 + 0.5)
    unregister_codec("int4")
    try:  # a file of a codec this process does not know is a logged rejection
        with pytest.raises(Rejected) as caught:
            decode_delta(data, layout, secret=None)
        assert caught.value.reason is RejectionReason.UNKNOWN_ENCODING
        assert "int4" in caught.value.detail and "fp4" in caught.value.detail
    finally:
        register_codec(int4)


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def test_a_registered_codec_carries_a_collective_round(tmp_path: Path, int4: Codec) -> None:
    """The collective exchange packs, decodes and keeps the residual through the codec's
    interface alone (one process: the round is the replica's own decoded delta)."""
    callback = CollectiveDiLoCo(inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
    callback.encoding = int4  # the options accept the built-in names; Python takes any codec
    model = _Regression()
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    data = [(inputs, inputs.sum(dim=1, keepdim=True))]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, optimizer, data, callbacks=[callback], output_dir=tmp_path)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer.fit(2)
    assert callback.outer_steps == 1
    residual = callback.residual
    assert residual is not None and residual.abs().max() > 0  # int4 dropped something
    # The model now holds the new global: the start minus the decoded int4 delta, and the
    # residual is what int4 dropped, so (decoded + residual) is the replica's pseudo-gradient
    # and the decoded delta is exactly its int4 round trip.
    assert callback.layout is not None
    keys = callback.layout.sync_keys  # the flat form's order
    local = torch.cat([model.state_dict()[key].reshape(-1) for key in keys])
    start = torch.cat([before[key].reshape(-1) for key in keys])
    decoded = start - local
    assert torch.allclose(decoded, int4.round_trip(decoded + residual), atol=1e-6)
    assert not torch.allclose(decoded, decoded + residual)


def test_the_codec_registry_is_the_only_place_that_names_the_codecs() -> None:
    """No module outside ``diloco/codecs/`` branches on a particular codec: the callers
    use the interface (its family and name)."""
    package = Path(codecs.__file__).parent.parent
    outside = [
        path
        for path in package.glob("*.py")
        if path.name not in {"encoding.py", "codec.py"}  # the earlier names' aliases
    ]
    codec_names = {"Encoding", "Compression", "INT8", "FP4", "BF16", "FP16", "Int8Codec"}
    named = {
        (path.name, node.id)
        for path in outside
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and node.id in codec_names
    }
    assert named == set()
