"""What a holder of the signing secret can and cannot do to a hub master (issue 22, items
4, 5, 9 and 10): a validly signed delta with an absurd metadata field is quarantined and
the round goes on; a claimed work figure is capped at what its node could have trained and
screened like a norm; no node incarnation's step range is applied twice; a node whose id
someone else uses moves to a new incarnation; and a junk pointer written while the master
publishes is reported. On a real directory hub, in one process (the resumed-worker test
with real, SIGKILLed processes is in tests/test_diloco_nodes.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic import Trainer
from speedtronic_callbacks.diloco import DiLoCoCallback, directory_transport
from speedtronic_callbacks.diloco import pointer as pointers
from speedtronic_callbacks.diloco.aggregation import RobustSettings
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, delta_path
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, decode_pointer
from speedtronic_callbacks.diloco.transport_base import Replaced, RetryingTransport, RetryPolicy
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Ledger,
    Rejected,
    RejectionReason,
    decode_delta,
    encode_file,
    encode_global,
    encode_outer,
    parse_header,
    to_wire,
)

torch.set_num_threads(1)

SECRET = b"the fleet's shared secret"


def make_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


LAYOUT = build_layout(make_model().state_dict())


@pytest.fixture(autouse=True)
def _release_masters() -> None:
    MasterLoop._active.clear()


def hub_of(tmp_path: Path) -> RetryingTransport:
    policy = RetryPolicy(attempts=1, initial=0.001, maximum=0.001, timeout=10)
    return RetryingTransport(DirectoryTransport(tmp_path / "hub"), policy)


def make_master(transport: RetryingTransport, **settings: object) -> MasterLoop:
    values: dict[str, object] = {
        "node_id": "master",
        "secret": SECRET,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "staleness_power": 0.0,
        **settings,
    }
    master = MasterLoop(transport, LAYOUT, MasterSettings(**values))  # type: ignore[arg-type]  # test knobs
    master.reconcile(make_model().state_dict())
    return master


def fields_of(info: DeltaInfo) -> dict[str, str]:
    """The metadata ``wire.encode_wire`` writes for ``info`` (fp32, whole model)."""
    fields = {
        "node_id": info.node_id,
        "local_step": str(info.local_step),
        "base_outer_step": str(info.base_outer_step),
        "incarnation": info.incarnation,
        "encoding": "fp32",
        "tokens": str(info.tokens),
        "samples": str(info.samples),
    }
    if info.first_step is not None:
        fields["first_step"] = str(info.first_step)
    return fields


def signed_delta(value: float, info: DeltaInfo, **overrides: str) -> bytes:
    """A validly signed delta of ``value`` everywhere whose metadata fields are those of
    ``info`` with ``overrides`` -- what a key holder can write."""
    delta = {key: torch.full(LAYOUT.wire_shapes[key], value) for key in LAYOUT.sync_keys}
    fields = {**fields_of(info), **overrides}
    return encode_file(
        "delta", to_wire(delta, LAYOUT), fields, fingerprint=LAYOUT.fingerprint, secret=SECRET
    )


def upload(transport: RetryingTransport, data: bytes) -> str:
    meta = parse_header(data).metadata
    path = delta_path(meta["node_id"], int(meta["local_step"]), meta["sha256"])
    transport.put(path, data)
    return path


def honest(
    transport: RetryingTransport,
    node: str,
    step: int,
    base: int,
    value: float = 0.01,
    *,
    tokens: int = 500,
    first: int | None = None,
    incarnation: str = "inc",
) -> str:
    first = step - 5 if first is None else first
    info = DeltaInfo(node, step, base, incarnation, tokens=tokens, first_step=first)
    return upload(transport, signed_delta(value, info))


def pointer_at(step: int, master: str = "master") -> bytes:
    """A validly signed pointer of outer ``step`` written under ``master``."""
    pointer = pointers.Pointer(
        outer_step=step,
        model_file=pointers.model_file_name(step),
        model_sha256="ab" * 32,
        outer_file=pointers.outer_file_name(step),
        outer_sha256="cd" * 32,
        fingerprint=LAYOUT.fingerprint,
        master=master,
        updated_at="now",
    )
    return pointers.encode_pointer(pointer, secret=SECRET)


def global_weight(master: MasterLoop) -> torch.Tensor:
    snapshot = master.snapshot()
    assert snapshot is not None
    return snapshot.global_state["weight"]


# -- item 4: one signed delta with an absurd field ------------------------------------------


def test_a_signed_400_digit_token_count_is_quarantined_and_aggregation_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport = hub_of(tmp_path)
    master = make_master(transport)
    good = honest(transport, "good", 5, 0)
    evil = upload(transport, signed_delta(1.0, DeltaInfo("evil", 5, 0, "x"), tokens="9" * 400))

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        report = master.sync_once()

    assert report.published and [item.path for item in report.applied] == [good]
    assert [(r.path, r.reason) for r in report.rejected] == [(evil, RejectionReason.BAD_METADATA)]
    lines = [r.getMessage() for r in caplog.records if evil in r.getMessage()]
    assert len(lines) == 1 and "'tokens'" in lines[0], lines  # one line: the file and field
    assert (tmp_path / "hub" / evil).exists()  # quarantined, kept for inspection
    assert master.state_dict()["rejected"] == {evil: transport.list_files("nodes/evil")[0].version}

    caplog.clear()
    later = honest(transport, "good", 10, 1, 0.02)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        second = master.sync_once()  # every later round runs; the file is not retried
    assert second.published and [item.path for item in second.applied] == [later]
    assert second.rejected == () and evil not in caplog.text
    (tmp_path / "hub" / evil).unlink()  # the operator removes it: the record goes too
    master.sync_once()
    assert master.state_dict()["rejected"] == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokens", "9" * 400),
        ("tokens", str(2**53 + 1)),
        ("tokens", "-5"),
        ("samples", "1_000"),
        ("local_step", "\u0663"),  # an Arabic-Indic digit, which int() would take
        ("local_step", str(10**12 + 1)),
        ("base_outer_step", "-2"),
        ("first_step", " 4"),
        ("first_step", "5"),  # not below its local_step
        ("node_id", "../other"),
        ("incarnation", "x" * 65),
        ("encoding", "e" * 33),
        ("fragment", "\u0663/\u0664"),
        ("numel", "1e3"),
    ],
)
def test_every_delta_field_is_typed_and_bounded(field: str, value: str) -> None:
    data = signed_delta(0.01, DeltaInfo("node", 5, 0, "inc", first_step=0), **{field: value})
    with pytest.raises(Rejected) as caught:
        decode_delta(data, LAYOUT, secret=SECRET)
    assert caught.value.reason is RejectionReason.BAD_METADATA
    assert repr(field) in caught.value.detail


def test_a_pointer_with_a_huge_outer_step_is_refused() -> None:
    with pytest.raises(Rejected, match="outer_step"):
        decode_pointer(pointer_at(10**13), fingerprint=LAYOUT.fingerprint, secret=SECRET)


@pytest.mark.parametrize("step", ["\u00b2", "1" * 5000, 10**40, -1, True])
def test_a_2_0_pointer_with_an_absurd_step_is_a_rejection(tmp_path: Path, step: object) -> None:
    # A superscript two passed str.isdigit() and then broke int() with a raw ValueError;
    # a huge step was adopted, and every later staleness weight overflowed.
    transport = hub_of(tmp_path)
    transport.prepare(create=True)
    transport.put(POINTER_PATH, json.dumps({"outer_step": step}).encode())
    master = MasterLoop(transport, LAYOUT, MasterSettings("master", secret=SECRET))
    with pytest.raises(Rejected, match="2.0 pointer has outer step") as caught:
        master.reconcile(make_model().state_dict())
    assert caught.value.reason is RejectionReason.BAD_METADATA


def test_global_files_named_beyond_any_valid_step_are_not_adopted(tmp_path: Path) -> None:
    # A restarted master adopts the newest complete version on the hub; a planted
    # model/outer pair named outer step 10**13 would have become its step, and every
    # staleness weight after it overflowed.
    transport = hub_of(tmp_path)
    first = make_master(transport)
    honest(transport, "w", 5, 0)
    assert first.sync_once().published
    first.release()
    huge = 10**13  # validly signed files of a key holder
    state = make_model().state_dict()
    transport.put(pointers.model_file_name(huge), encode_global(state, huge, LAYOUT, secret=SECRET))
    outer = encode_outer({}, Ledger(), huge, LAYOUT, secret=SECRET)
    transport.put(pointers.outer_file_name(huge), outer)
    MasterLoop._active.clear()

    restarted = make_master(transport)

    assert restarted.outer_step == 1


# -- item 5: one signed delta takes the round's weight --------------------------------------


def test_a_claim_of_1e30_tokens_is_refused_and_one_of_2_to_the_52_is_capped(
    tmp_path: Path,
) -> None:
    transport = hub_of(tmp_path)
    master = make_master(transport, inner_steps=5, max_step_tokens=100)
    before = global_weight(master).clone()
    honest(transport, "a", 5, 0, 0.01)
    honest(transport, "b", 5, 0, 0.03)
    huge = upload(transport, signed_delta(0.02, DeltaInfo("e", 5, 0, "x"), tokens=str(10**30)))
    claim = DeltaInfo("f", 5, 0, "x", tokens=2**52, first_step=0)
    upload(transport, signed_delta(0.05, claim))

    report = master.sync_once()

    assert [(r.path, r.reason) for r in report.rejected] == [(huge, RejectionReason.BAD_METADATA)]
    weights = {item.node_id: item.weight for item in report.applied}
    # 5 steps x 100 tokens at most: the claim counts like the honest 500, not 1e13 times more
    assert weights == {"a": 1.0, "b": 1.0, "f": 1.0}
    assert [item.work for item in report.applied] == [500.0] * 3
    moved = before - global_weight(master)  # lr 1: the mean of the three deltas
    assert torch.allclose(moved, torch.full_like(moved, (0.01 + 0.03 + 0.05) / 3))


@pytest.mark.parametrize("policy", ["clip", "reject"])
def test_claimed_work_is_screened_like_norms(tmp_path: Path, policy: str) -> None:
    transport = hub_of(tmp_path)
    robust = RobustSettings(policy, factor=10.0)  # type: ignore[arg-type]  # a test value
    master = make_master(transport, robust=robust, max_step_tokens=10**9)
    for step in (5, 10, 15):  # honest rounds: a history of 500-token deltas
        honest(transport, "good", step, master.outer_step, step / 1000, tokens=500)
        assert master.sync_once().published
    honest(transport, "good", 20, master.outer_step, 0.02, tokens=500)
    heavy = honest(transport, "heavy", 20, master.outer_step, 0.03, tokens=500 * 1000)

    report = master.sync_once()

    weights = {item.node_id: item.weight for item in report.applied}
    if policy == "clip":  # at most 10 x the median of the recent figures
        assert [item.work for item in report.applied] == [500.0, 5000.0]
        assert weights == pytest.approx({"good": 2 / 11, "heavy": 20 / 11})
    else:
        assert weights == {"good": 1.0}
        assert [(r.path, r.reason) for r in report.rejected] == [(heavy, RejectionReason.OUTLIER)]
        assert "claimed work" in report.rejected[0].detail
    assert master.state_dict()["work_history"] == {
        "tokens": [500.0] * 3 + [500.0, 5000.0][: len(report.applied)]
    }


def test_without_a_configured_cap_the_master_uses_its_own_step_batch(tmp_path: Path) -> None:
    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(x), y)

    model = Regression()
    inputs = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    callback = DiLoCoCallback(
        role="master", node_id="m", hub_dir=str(tmp_path / "hub"), inner_steps=2
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        [(inputs, inputs[:, :2])],
        callbacks=[callback],
        output_dir=tmp_path / "m",
    )
    trainer.fit(4)

    assert callback.node is not None and callback.node.master is not None
    per_step = [trainer.tokens // 4, trainer.samples // 4]  # what each of the 4 steps took
    assert per_step[1] == 6 and callback.node.master.state_dict()["step_work"] == per_step
    assert callback.node.master.settings.inner_steps == 2


# -- item 9 (master side): no step range of a node incarnation is applied twice -------------


def test_the_master_applies_no_step_range_of_a_node_incarnation_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport = hub_of(tmp_path)
    master = make_master(transport)
    honest(transport, "w", 5, 0, 0.01)
    honest(transport, "w", 10, 0, 0.02)  # one round may hold several ranges of one node
    assert len(master.sync_once().applied) == 2
    again = honest(transport, "w", 10, 1, 0.03)  # steps 6..10 once more, other numbers
    reaching_back = honest(transport, "w", 12, 1, 0.04, first=7)
    legacy = upload(transport, signed_delta(0.05, DeltaInfo("w", 9, 1, "inc", tokens=5)))
    later = honest(transport, "w", 15, 1, 0.06, first=10)
    other_life = honest(transport, "w", 5, 1, 0.07, incarnation="fresh")

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        report = master.sync_once()

    assert sorted(item.path for item in report.applied) == sorted([later, other_life])
    assert {r.path: r.reason for r in report.rejected} == {
        again: RejectionReason.OVERLAP,
        reaching_back: RejectionReason.OVERLAP,
        legacy: RejectionReason.OVERLAP,  # an earlier version's file: no range, step 9 <= 10
    }
    assert "steps up to 10 were applied already" in caplog.text
    snapshot = master.snapshot()
    assert snapshot is not None
    assert snapshot.ledger.covered == {"w": {"inc": {"": 15}, "fresh": {"": 5}}}


# -- a node whose id another process uses ------------------------------------------------


def test_a_node_whose_incarnation_someone_else_sends_under_moves_to_a_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport = hub_of(tmp_path)
    master = make_master(transport)
    model = make_model()
    node = DiLoCoNode(
        model,
        transport,
        LAYOUT,
        NodeSettings(node_id="w", role="worker", inner_steps=5, poll_interval=0.0, secret=SECRET),
    )
    node.start(0)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(0.001)
        node.on_step(step)
        assert node.wait_idle(10)
    assert master.sync_once().published  # the node's delta of steps 1..5
    first_life = node.incarnation
    forged = DeltaInfo("w", 10**9, master.outer_step, first_life, first_step=5)
    upload(transport, signed_delta(0.001, forged))  # a key holder, under the node's id
    assert master.sync_once().published

    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        for step in range(6, 11):
            with torch.no_grad():
                model.weight.add_(0.001)
            node.on_step(step)
            assert node.wait_idle(10)
        report = master.sync_once()

    assert node.incarnation != first_life
    assert "another process uses node id 'w'" in caplog.text
    assert [(item.node_id, item.local_step) for item in report.applied] == [("w", 10)]
    assert report.rejected == ()  # not refused as overlapping the forged range
    node.stop()


# -- item 10: a junk pointer written while the master publishes ------------------------------


class JunkRightBeforeTheSwap(DirectoryTransport):
    """Writes ``junk`` over the pointer at the last moment of a round: right before the
    master swaps its new pointer in (``None``: a FIFO instead)."""

    junk: bytes | None = b""
    armed = False

    def replace(self, path: str, data: bytes) -> Replaced:
        if self.armed and path == POINTER_PATH:
            self.armed = False
            target = self.root / POINTER_PATH
            target.unlink()
            if self.junk is None:
                os.mkfifo(target)
            else:
                target.write_bytes(self.junk)
        return super().replace(path, data)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "read-then-replace"])
@pytest.mark.parametrize(
    "junk", [b"{not json", b"[" * 100_000, None], ids=["garbage", "deep", "fifo"]
)
def test_a_junk_pointer_written_during_a_round_is_always_reported(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    exchange: bool,
    junk: bytes | None,
) -> None:
    if not exchange:
        monkeypatch.setattr(directory_transport, "_rename2", None)
    elif directory_transport._rename2 is None:
        pytest.skip("renameat2 is not available on this system")
    hub = JunkRightBeforeTheSwap(tmp_path / "hub")
    hub.junk = junk
    transport = RetryingTransport(hub, RetryPolicy(attempts=1, initial=0.001, maximum=0.001))
    master = make_master(transport)
    honest(transport, "w", 5, 0)
    hub.armed = True

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        report = master.sync_once()

    assert report.published and master.outer_step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "hub pointer" in warnings[0], warnings
    assert "during the round" in warnings[0]
    raw = hub.get(POINTER_PATH)  # the new pointer replaced the junk
    assert raw is not None
    assert decode_pointer(raw, fingerprint=LAYOUT.fingerprint, secret=SECRET).outer_step == 1
    assert master.halted is None
    assert [p.name for p in (tmp_path / "hub" / "global").iterdir() if p.name.startswith(".")] == []


def test_another_masters_pointer_swapped_out_during_a_round_halts_this_master(
    tmp_path: Path,
) -> None:
    hub = JunkRightBeforeTheSwap(tmp_path / "hub")
    transport = RetryingTransport(hub, RetryPolicy(attempts=1, initial=0.001, maximum=0.001))
    master = make_master(transport)
    hub.junk = pointer_at(1, master="second-master")
    honest(transport, "w", 5, 0)
    hub.armed = True

    assert master.sync_once().published
    assert master.halted is not None and "second-master" in master.halted


def test_the_directory_swap_returns_exactly_what_it_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = directory_transport._rename2
    if swap is None:
        pytest.skip("renameat2 is not available on this system")
    hub = DirectoryTransport(tmp_path / "hub")
    hub.prepare(create=True)
    assert hub.replace(POINTER_PATH, b"first") == Replaced(None, exact=True)  # nothing there

    def written_a_moment_before(source: Path, target: Path, flags: int) -> None:
        target.write_bytes(b"written between any read and the swap")
        swap(source, target, flags)

    monkeypatch.setattr(directory_transport, "_rename2", written_a_moment_before)
    replaced = hub.replace(POINTER_PATH, b"second")

    assert replaced == Replaced(b"written between any read and the swap", exact=True)
    assert hub.get(POINTER_PATH) == b"second"
    assert sorted(p.name for p in (tmp_path / "hub" / "global").iterdir()) == ["step_count.json"]


# -- item 9 (node side): a resumed node's deltas still waiting on the hub, per fragment -----


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))  # blocks "0" and "2"


def stream_node(transport: RetryingTransport, model: nn.Sequential) -> DiLoCoNode:
    settings = NodeSettings(
        node_id="w", role="worker", inner_steps=4, poll_interval=0.0, secret=SECRET, fragments=2
    )
    return DiLoCoNode(model, transport, build_layout(model.state_dict()), settings)


def train(node: DiLoCoNode, model: nn.Sequential, steps: range) -> None:
    """Deterministic steps (the same weights for the same step numbers); each trains 8
    tokens and 2 samples."""
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        optimizer.step()
        node.record_work(8 * step, 2 * step)
        node.on_step(step)
        assert node.wait_idle(10)


def test_a_resumed_streaming_node_skips_what_waits_on_the_hub_fragment_by_fragment(
    tmp_path: Path,
) -> None:
    transport = hub_of(tmp_path)
    model = blocks()
    master = MasterLoop(
        transport, build_layout(model.state_dict()), MasterSettings("master", secret=SECRET)
    )
    master.reconcile(model.state_dict())
    node = stream_node(transport, model)
    node.start(0)
    assert node.wait_idle(10)  # the first global is fetched: installed at step 1
    train(node, model, range(1, 6))  # sends fragment 1 at step 2, fragment 0 at 4
    assert master.sync_once().published
    checkpoint = node.state_dict()
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    train(node, model, range(6, 11))  # sends 1/2 at 6, 0/2 at 8, 1/2 at 10: they wait
    node.stop()  # killed: the checkpoint of step 5 is the newest

    model = blocks()
    model.load_state_dict(weights)
    resumed = stream_node(transport, model)
    resumed.load_state_dict(checkpoint)
    resumed.start(5)
    train(resumed, model, range(6, 15))  # recomputes 6..10; then sends 0/2 at 12, 1/2 at 14
    resumed.stop()
    report = master.sync_once()

    assert report.rejected == ()  # nothing the hub had was sent again
    spans: dict[str, list[tuple[int | None, int]]] = {"0/2": [], "1/2": []}
    for item, fragment in zip(report.applied, report.norm_fragments, strict=True):
        spans[fragment].append((item.first_step, item.local_step))
    # Fragment 1's steps 9 and 10 were sent (at 10) but fragment 0's were not: each
    # fragment skips exactly what it sent.
    assert sorted(spans["0/2"]) == [(4, 8), (8, 12)]  # type: ignore[type-var]  # ints here
    assert sorted(spans["1/2"]) == [(2, 6), (6, 10), (10, 14)]  # type: ignore[type-var]
    assert sum(item.tokens for item in report.applied) == 8 * 10  # steps 5..14, each once
    assert resumed.stats.resyncs == 1
