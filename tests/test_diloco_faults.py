"""DiLoCo under faults, in one process: flaky and broken transports, corrupt and forged
deltas, a master killed and restarted, a worker resumed from a checkpoint, and the bugs of
the original implementation (zero delta at a boundary install, rollback on resume,
dedupe by name, duplicate master loops)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.master import (
    MasterConflictError,
    MasterLoop,
    MasterSettings,
    delta_path,
)
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, decode_pointer
from speedtronic_callbacks.diloco.transport_base import (
    PermanentTransportError,
    RemoteFile,
    Replaced,
    RetryingTransport,
    RetryPolicy,
    TransientTransportError,
    Transport,
)
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    RejectionReason,
    decode_delta,
    encode_delta,
    parse_header,
)

TRUE_WEIGHTS = torch.tensor([[1.0, -2.0, 3.0, 0.5]])


def make_model() -> nn.Linear:
    torch.manual_seed(0)  # every node starts from the same weights, as with a shared seed
    return nn.Linear(4, 1)


@dataclass
class Node:
    """A node under test: its model, optimizer, data and DiLoCo state machine."""

    node: DiLoCoNode
    model: nn.Linear
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    step: int = 0
    resets: list[int] = field(default_factory=list)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            loss = nn.functional.mse_loss(self.model(self.inputs), self.inputs @ TRUE_WEIGHTS.T)
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            self.optimizer.step()
            outcome = self.node.on_step(self.step)
            if outcome.installed is not None:
                self.resets.append(self.step)
            assert self.node.wait_idle(10)


def global_loss(node: DiLoCoNode) -> float:
    inputs = torch.randn(256, 4, generator=torch.Generator().manual_seed(99))
    model = make_model()
    assert node.master is not None
    snapshot = node.master.snapshot()
    assert snapshot is not None
    model.load_state_dict(snapshot.global_state)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(inputs), inputs @ TRUE_WEIGHTS.T))


def build(
    hub: Transport,
    node_id: str,
    *,
    role: str = "worker",
    seed: int = 1,
    inner_steps: int = 2,
    secret: bytes | None = None,
    audit: Path | None = None,
    delete_applied: bool = True,
    attempts: int = 4,
    max_staleness: int | None = None,
    outer_momentum: float = 0.5,
) -> Node:
    model = make_model()
    layout = build_layout(model.state_dict())
    policy = RetryPolicy(attempts=attempts, initial=0.001, maximum=0.001, timeout=10)
    transport = RetryingTransport(hub, policy, sleep=lambda _: None)
    master = None
    if role == "master":
        settings = MasterSettings(
            node_id=node_id,
            secret=secret,
            delete_applied=delete_applied,
            max_staleness=max_staleness,
            outer_momentum=outer_momentum,  # 0.9 is tuned for H ~ 500; it rings at H = 2
        )
        master = MasterLoop(transport, layout, settings, audit_path=audit)
    node = DiLoCoNode(
        model,
        transport,
        layout,
        NodeSettings(
            node_id=node_id,
            role="master" if role == "master" else "worker",
            inner_steps=inner_steps,
            poll_interval=0.0,
            secret=secret,
        ),
        master=master,
    )
    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return Node(node, model, optimizer, inputs)


def start(*nodes: Node) -> None:
    for item in nodes:
        item.node.start(item.step)
        assert item.node.wait_idle(10)


def stop(*nodes: Node) -> None:
    for item in nodes:
        item.node.stop()


def audit_records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def applied_hashes(path: Path) -> list[str]:
    hashes: list[str] = []
    for record in audit_records(path):
        applied = record["applied"]
        assert isinstance(applied, list)
        hashes.extend(str(item["sha256"]) for item in applied)
    return hashes


def run_round_robin(nodes: Sequence[Node], rounds: int, steps: int = 2) -> None:
    for _ in range(rounds):
        for item in nodes:
            item.train(steps)


@pytest.fixture(autouse=True)
def _release_masters() -> None:
    MasterLoop._active.clear()


# -- the happy path and the original's bugs -------------------------------------------------


def test_master_and_workers_improve_the_global_model(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", seed=1, audit=audit)
    workers = [build(hub, f"worker-{i}", seed=2 + i) for i in range(2)]
    start(master, *workers)
    initial = global_loss(master.node)

    run_round_robin([master, *workers], rounds=8)

    assert master.node.master is not None
    assert master.node.master.outer_step >= 6
    assert global_loss(master.node) < initial / 5
    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))  # each delta applied exactly once
    nodes = {
        str(item["node_id"])
        for record in audit_records(audit)
        for item in record["applied"]  # type: ignore[attr-defined]  # a JSON list
    }
    assert nodes == {"master", "worker-0", "worker-1"}
    assert all(w.node.installed_step >= 1 for w in workers)
    metrics = master.node.metrics()
    assert metrics["diloco/deltas_included"] == len(hashes)
    assert metrics["diloco/bytes_up"] > 0 and metrics["diloco/rounds"] >= 6
    stop(master, *workers)
    leftovers = list((tmp_path / "hub" / "nodes").rglob("*.safetensors"))
    assert len(leftovers) <= 3  # applied deltas are deleted; at most the last ones wait


def test_upload_happens_before_install_so_no_zero_delta(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = build(hub, "master", role="master", delete_applied=False)
    worker = build(hub, "worker", seed=3, inner_steps=1)
    start(master, worker)
    worker.train(1)  # installs outer step 0
    master.train(2)  # the master's own delta is uploaded at its boundary
    assert master.node.master is not None
    assert master.node.master.sync_once().outer_step == 1
    worker.train(1)  # uploads; its poll fetches outer step 1 into the candidate slot
    candidate = worker.node.results.candidate
    assert candidate is not None and candidate.outer_step == 1
    before = worker.node.installed_step
    worker.train(1)  # boundary with a ready global: upload first, then install

    uploads = sorted(
        (p for p in (tmp_path / "hub" / "nodes" / "worker").glob("*.safetensors")),
        key=lambda p: int(p.name.split("_")[1]),
    )
    layout = build_layout(worker.model.state_dict())
    last = decode_delta(uploads[-1].read_bytes(), layout, secret=None)
    assert last.info.local_step == worker.step
    assert all(bool(t.abs().sum() > 0) for t in last.tensors.values())  # not a zero delta
    assert worker.node.installed_step == 1 > before
    stop(master, worker)


def test_optimizer_reset_is_signalled_only_when_a_global_is_installed(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = build(hub, "master", role="master")
    worker = build(hub, "worker", seed=2)
    start(master, worker)
    worker.train(1)
    run_round_robin([master, worker], rounds=3)
    assert worker.resets
    for step in worker.resets:
        assert step in range(1, worker.step + 1)
    assert len(worker.resets) == worker.node.stats.installs
    stop(master, worker)


# -- flaky and broken transports ---------------------------------------------------------


class FlakyTransport(Transport):
    """Fails every other call. Half of the failing puts happen *after* the file was
    written, so the caller believes an upload failed that actually arrived."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.calls = 0
        self.failures = 0
        self.broken = False
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return self.inner.location

    def _tick(self) -> bool:
        with self._lock:
            self.calls += 1
            fail = self.broken or self.calls % 2 == 0
            self.failures += fail
            return fail

    def _fail(self, operation: str) -> None:
        if self.broken:
            raise PermanentTransportError(operation, "401 Unauthorized: bad token")
        raise TransientTransportError(operation, "connection reset")

    def prepare(self, *, create: bool) -> None:
        if self._tick():
            self._fail("prepare")
        self.inner.prepare(create=create)

    def list_files(self, prefix: str) -> list[RemoteFile]:
        if self._tick():
            self._fail("list")
        return self.inner.list_files(prefix)

    def get(self, path: str) -> bytes | None:
        if self._tick():
            self._fail("get")
        return self.inner.get(path)

    def put(self, path: str, data: bytes) -> None:
        fail = self._tick()
        if fail and not self.broken and self.calls % 4 == 0:
            self.inner.put(path, data)  # it arrived, but the caller sees an error
        if fail:
            self._fail("put")
        self.inner.put(path, data)

    def delete(self, paths: Sequence[str]) -> None:
        if self._tick():
            self._fail("delete")
        self.inner.delete(paths)


def test_half_of_all_calls_failing_transiently_still_converges_exactly_once(
    tmp_path: Path,
) -> None:
    flaky = FlakyTransport(DirectoryTransport(tmp_path / "hub"))
    audit = tmp_path / "audit.jsonl"
    master = build(flaky, "master", role="master", audit=audit, attempts=4)
    workers = [build(flaky, f"w{i}", seed=5 + i, attempts=4) for i in range(2)]
    start(master, *workers)
    initial = global_loss(master.node)

    run_round_robin([master, *workers], rounds=8)

    assert flaky.failures > 50
    assert master.node.master is not None and master.node.master.outer_step >= 4
    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))
    assert global_loss(master.node) < initial
    stop(master, *workers)


def test_a_lost_acknowledgement_is_resent_and_deduplicated(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")

    class AckLost(Transport):
        """The first delta upload arrives but reports a failure (a lost response)."""

        def __init__(self) -> None:
            self.lost = 0

        @property
        def location(self) -> str:
            return hub.location

        def prepare(self, *, create: bool) -> None:
            hub.prepare(create=create)

        def list_files(self, prefix: str) -> list[RemoteFile]:
            return hub.list_files(prefix)

        def get(self, path: str) -> bytes | None:
            return hub.get(path)

        def put(self, path: str, data: bytes) -> None:
            hub.put(path, data)
            if path.startswith("nodes/") and self.lost == 0:
                self.lost += 1
                raise TransientTransportError("put", "response lost")

        def delete(self, paths: Sequence[str]) -> None:
            hub.delete(paths)

    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    worker = build(AckLost(), "worker", seed=4, attempts=1)
    start(master, worker)
    worker.train(2)  # boundary: the upload "fails" after arriving
    assert worker.node.stats.upload_failures == 1
    run_round_robin([master, worker], rounds=4)

    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))
    assert worker.node.stats.uploads >= 2
    stop(master, worker)


def test_permanent_errors_are_reported_once_and_training_continues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = DirectoryTransport(tmp_path / "hub")
    master = build(directory, "master", role="master")
    broken = FlakyTransport(directory)
    broken.broken = True
    worker = build(broken, "worker", seed=2)
    start(master)
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        start(worker)
        worker.train(10)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "401 Unauthorized" in errors[0].getMessage()
    assert "local training continues" in errors[0].getMessage()
    assert worker.step == 10  # trained locally throughout
    assert worker.node.reporter.permanent_errors >= 5

    broken.broken = False  # the operator fixes the token
    broken.calls = 1  # odd: the next call succeeds
    for _ in range(6):
        worker.train(2)
        master.train(1)
    assert worker.node.installed_step >= 1
    stop(master, worker)


def test_a_missing_hub_directory_does_not_stop_a_worker(tmp_path: Path) -> None:
    worker = build(DirectoryTransport(tmp_path / "not-mounted"), "worker")
    start(worker)
    worker.train(6)
    assert worker.node.reporter.permanent_errors >= 1
    assert worker.node.installed_step == -1
    stop(worker)


# -- hostile or broken files -----------------------------------------------------------------


class CountingTransport(DirectoryTransport):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: dict[str, int] = {}

    def get(self, path: str) -> bytes | None:
        self.gets[path] = self.gets.get(path, 0) + 1
        return super().get(path)


def test_corrupt_delta_is_rejected_once_and_never_downloaded_again(tmp_path: Path) -> None:
    hub = CountingTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    worker = build(hub, "worker", seed=2)
    start(master, worker)
    bad = "nodes/evil/delta_5_0123456789abcdef.safetensors"
    hub.put(bad, b"not safetensors at all")

    run_round_robin([master, worker], rounds=4)

    assert hub.gets[bad] == 1
    rejections = [
        item
        for record in audit_records(audit)
        for item in record["rejected"]  # type: ignore[attr-defined]  # a JSON list
    ]
    assert [(r["path"], r["reason"]) for r in rejections] == [(bad, "corrupt")]
    assert master.node.metrics()["diloco/deltas_rejected"] == 1
    assert master.node.master is not None and master.node.master.outer_step >= 3

    hub.put(bad, b"replaced, still not safetensors")  # a new version is examined again
    master.train(1)
    assert hub.gets[bad] == 2
    stop(master, worker)


def test_delta_signed_with_the_wrong_key_is_rejected(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", secret=b"shared", audit=audit)
    honest = build(hub, "honest", seed=2, secret=b"shared")
    intruder = build(hub, "intruder", seed=3, secret=b"guessed")
    start(master, honest, intruder)
    run_round_robin([master, honest, intruder], rounds=2)
    assert master.node.master is not None
    layout = build_layout(make_model().state_dict())
    bogus = {key: torch.full(layout.wire_shapes[key], 5.0) for key in layout.sync_keys}
    base = master.node.master.outer_step
    for secret, step in ((b"guessed", 3), (None, 4)):  # a wrong key, and no key at all
        blob = encode_delta(bogus, DeltaInfo("intruder", step, base, "x"), layout, secret=secret)
        hub.put(delta_path("intruder", step, parse_header(blob).metadata["sha256"]), blob)

    run_round_robin([master, honest], rounds=2)

    records = audit_records(audit)
    applied_nodes = {
        item["node_id"]
        for record in records
        for item in record["applied"]  # type: ignore[attr-defined]  # a JSON list
    }
    reasons = sorted(
        item["reason"]
        for record in records
        for item in record["rejected"]  # type: ignore[attr-defined]  # a JSON list
    )
    assert applied_nodes == {"master", "honest"}
    assert reasons == [RejectionReason.BAD_SIGNATURE.value, RejectionReason.UNSIGNED.value]
    assert intruder.node.installed_step == -1  # it cannot verify the master's pointer either
    assert intruder.node.reporter.permanent_errors >= 1
    stop(master, honest, intruder)


def test_nan_foreign_and_mislabelled_deltas_are_rejected(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    start(master)
    layout = build_layout(make_model().state_dict())
    info = DeltaInfo("evil", 7, 0, "x")
    nan = {key: torch.full(layout.wire_shapes[key], float("nan")) for key in layout.sync_keys}
    blob = encode_delta(nan, info, layout)
    hub.put(delta_path("evil", 7, parse_header(blob).metadata["sha256"]), blob)
    foreign = build_layout(make_model().state_dict(), "a different config")
    ones = {key: torch.ones(layout.wire_shapes[key]) for key in layout.sync_keys}
    blob = encode_delta(ones, info, foreign)
    hub.put(delta_path("evil", 8, parse_header(blob).metadata["sha256"]), blob)
    blob = encode_delta(ones, info, layout)  # header says step 7, the name says 9
    hub.put(delta_path("evil", 9, parse_header(blob).metadata["sha256"]), blob)

    master.train(2)

    reasons = (
        sorted(
            item["reason"]
            for record in audit_records(audit)
            for item in record["rejected"]  # type: ignore[attr-defined]  # a JSON list
        )
        if audit.exists()
        else []
    )
    assert master.node.stats.deltas_rejected == 3
    assert master.node.stats.last_round is not None
    found = sorted(r.reason.value for r in master.node.stats.last_round.rejected) or reasons
    assert set(found) <= {"non_finite", "foreign_fingerprint", "name_mismatch"}
    stop(master)


def test_stale_deltas_weigh_less_and_too_stale_ones_are_rejected(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit, max_staleness=2)
    start(master)
    master.train(10)  # several outer steps from the master's own deltas
    assert master.node.master is not None
    outer = master.node.master.outer_step
    assert outer >= 4
    layout = build_layout(make_model().state_dict())
    small = {key: torch.full(layout.wire_shapes[key], 1e-3) for key in layout.sync_keys}
    for node, base in (("slightly-stale", outer - 1), ("very-stale", outer - 3)):
        blob = encode_delta(small, DeltaInfo(node, 1, base, "x"), layout)
        hub.put(delta_path(node, 1, parse_header(blob).metadata["sha256"]), blob)

    report = master.node.master.sync_once()

    applied = {item.node_id: item for item in report.applied if item.node_id != "master"}
    assert list(applied) == ["slightly-stale"]
    assert applied["slightly-stale"].staleness == 1
    assert applied["slightly-stale"].weight == pytest.approx(2**-0.5)
    assert [(r.path.split("/")[1], r.reason) for r in report.rejected] == [
        ("very-stale", RejectionReason.TOO_STALE)
    ]
    stop(master)


# -- restarts --------------------------------------------------------------------------------


def test_master_killed_and_restarted_never_rolls_back_or_reapplies(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit, delete_applied=False)
    worker = build(hub, "worker", seed=2)
    start(master, worker)
    run_round_robin([master, worker], rounds=2)
    checkpoint = master.node.state_dict()
    checkpoint_model = {k: v.clone() for k, v in master.model.state_dict().items()}
    assert master.node.master is not None
    checkpoint_outer = master.node.master.outer_step
    run_round_robin([master, worker], rounds=3)
    published = master.node.master.outer_step
    assert published > checkpoint_outer
    master.node.master.release()  # the process dies: no stop(), no final checkpoint

    restarted = build(hub, "master", role="master", audit=audit, delete_applied=False)
    restarted.model.load_state_dict(checkpoint_model)
    restarted.step = int(checkpoint["checkpoint_step"])  # type: ignore[call-overload]  # an int
    restarted.node.load_state_dict(checkpoint)
    start(restarted)
    assert restarted.node.master is not None
    assert restarted.node.master.outer_step == published  # adopted, not rolled back
    raw = hub.get(POINTER_PATH)
    assert raw is not None
    layout = build_layout(make_model().state_dict())
    assert decode_pointer(raw, fingerprint=layout.fingerprint, secret=None).outer_step == published

    run_round_robin([restarted, worker], rounds=3)

    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))  # nothing applied twice across the restart
    steps = [int(r["outer_step"]) for r in audit_records(audit)]  # type: ignore[call-overload]
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    assert restarted.node.master.outer_step > published
    stop(restarted, worker)


def test_a_fresh_master_adopts_the_hub_instead_of_bootstrapping(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = build(hub, "master", role="master")
    start(master)
    master.train(6)
    assert master.node.master is not None
    published = master.node.master.outer_step
    master.node.master.release()

    fresh = build(hub, "master", role="master")
    start(fresh)
    assert fresh.node.master is not None
    assert fresh.node.master.outer_step == published
    fresh.train(1)
    assert fresh.node.installed_step == published
    stop(fresh)


def test_a_failed_publication_changes_nothing_and_is_retried(tmp_path: Path) -> None:
    class PointerDown(DirectoryTransport):
        down = False

        def replace(self, path: str, data: bytes) -> Replaced:  # how the pointer is written
            if self.down and path == POINTER_PATH:
                raise PermanentTransportError("put", "quota exceeded")
            return super().replace(path, data)

    hub = PointerDown(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    start(master)
    master.train(2)
    assert master.node.master is not None
    before = master.node.master.outer_step
    hub.down = True
    master.train(4)
    assert master.node.master.outer_step == before
    hub.down = False
    master.train(2)
    assert master.node.master.outer_step > before
    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))
    steps_applied = {
        item["local_step"]
        for record in audit_records(audit)
        for item in record["applied"]  # type: ignore[attr-defined]  # a JSON list
    }
    assert {4, 6} <= steps_applied  # the deltas of the failed rounds were applied later
    stop(master)


def test_a_publication_reported_failed_that_landed_is_adopted(tmp_path: Path) -> None:
    class LostPointerAck(DirectoryTransport):
        lose_next = False

        def replace(self, path: str, data: bytes) -> Replaced:  # how the pointer is written
            replaced = super().replace(path, data)
            if self.lose_next and path == POINTER_PATH:
                self.lose_next = False
                raise PermanentTransportError("put", "connection closed before the reply")
            return replaced

    hub = LostPointerAck(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    start(master)
    master.train(2)
    assert master.node.master is not None
    master.node.master.sync_once()
    before = master.node.master.outer_step
    layout = build_layout(make_model().state_dict())
    delta = {key: torch.full(layout.wire_shapes[key], 1e-3) for key in layout.sync_keys}
    blob = encode_delta(delta, DeltaInfo("w", 9, before, "x"), layout)
    hub.put(delta_path("w", 9, parse_header(blob).metadata["sha256"]), blob)
    hub.lose_next = True
    with pytest.raises(PermanentTransportError):
        master.node.master.sync_once()  # published, but reported as failed
    assert master.node.master.outer_step == before  # not committed in memory

    master.train(4)  # the next rounds adopt the landed step instead of halting

    assert master.node.master.halted is None
    assert master.node.master.outer_step > before + 1
    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))
    stop(master)


def test_second_master_loop_in_one_process_is_refused(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    first = build(hub, "master", role="master")
    start(first)
    second = build(hub, "master", role="master")
    with pytest.raises(MasterConflictError, match="already running"):
        second.node.start(0)
    stop(first)
    start(second)  # after a clean stop the hub is free again
    stop(second)


def test_a_second_master_on_the_same_hub_is_detected(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    first = build(hub, "master-a", role="master")
    start(first)
    first.train(2)
    assert first.node.master is not None
    first.node.master.release()
    other = build(hub, "master-b", role="master")
    start(other)
    other.train(2)
    assert other.node.master is not None
    other.node.master.sync_once()  # master-b publishes (its own step-2 delta at the latest)
    raw = hub.get(POINTER_PATH)
    assert raw is not None
    layout = build_layout(make_model().state_dict())
    assert decode_pointer(raw, fingerprint=layout.fingerprint, secret=None).master == "master-b"
    first.train(1)  # master-a's next round finds master-b's pointer
    assert first.node.master.halted is not None
    assert "master-b" in first.node.master.halted
    stop(first, other)


def test_a_resumed_worker_installs_the_latest_global(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = build(hub, "master", role="master")
    worker = build(hub, "worker", seed=2, inner_steps=4)
    start(master, worker)
    worker.train(5)  # one upload at step 4, one step of unsent progress
    checkpoint = worker.node.state_dict()
    checkpoint_model = {k: v.clone() for k, v in worker.model.state_dict().items()}
    stop(worker)
    run_round_robin([master], rounds=4)  # the hub moves on while the worker is down
    assert master.node.master is not None
    latest = master.node.master.outer_step

    resumed = build(hub, "worker", seed=2, inner_steps=4)
    resumed.model.load_state_dict(checkpoint_model)
    resumed.node.load_state_dict(checkpoint)
    resumed.step = 5
    start(resumed)
    resumed.train(1)

    assert resumed.node.installed_step == latest
    assert resumed.node.stats.resyncs == 0
    assert resumed.node.pending is not None  # unsent progress kept: nothing sent it before
    resumed.train(2)  # the boundary at step 8 sends it
    assert resumed.node.stats.uploads == 1
    stop(master, resumed)


def test_a_resumed_worker_drops_work_it_had_already_sent(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    worker = build(hub, "worker", seed=2, inner_steps=4)
    start(master, worker)
    worker.train(5)
    checkpoint = worker.node.state_dict()
    checkpoint_model = {k: v.clone() for k, v in worker.model.state_dict().items()}
    worker.train(7)  # uploads at 8 and 12 include the progress the checkpoint holds
    stop(worker)  # killed
    master.train(2)

    resumed = build(hub, "worker", seed=2, inner_steps=4)
    resumed.model.load_state_dict(checkpoint_model)
    resumed.node.load_state_dict(checkpoint)
    resumed.step = 5
    start(resumed)
    assert master.node.master is not None
    outer_at_resume = master.node.master.outer_step
    resumed.train(3)  # recomputes steps 6..8, which the killed run sent (at 8 and 12) ...
    master.train(2)
    resumed.train(8)  # ... and 9..12; then new work, sent at step 16
    master.train(2)

    assert resumed.node.stats.resyncs == 1  # the checkpointed unsent delta was dropped
    hashes = applied_hashes(audit)
    assert len(hashes) == len(set(hashes))
    applied = [
        item
        for record in audit_records(audit)
        for item in record["applied"]  # type: ignore[attr-defined]  # a JSON list
        if item["node_id"] == "worker"
    ]
    # Issue 22 item 9: each step's progress once -- not step 8 of the first run and again
    # the resumed run's recomputation of it (which this test asserted before).
    ranges = [(item["first_step"], item["local_step"]) for item in applied]
    assert sorted(ranges) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    new_work = next(item for item in applied if item["local_step"] == 16)
    assert int(new_work["base_outer_step"]) >= outer_at_resume  # from a global after resume
    stop(master, resumed)


def test_dedupe_is_by_content_not_by_name(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    audit = tmp_path / "audit.jsonl"
    master = build(hub, "master", role="master", audit=audit)
    start(master)
    master.train(2)
    assert master.node.master is not None
    master.node.master.sync_once()  # settle the master's own upload of step 2
    layout = build_layout(make_model().state_dict())
    delta = {key: torch.full(layout.wire_shapes[key], 1e-3) for key in layout.sync_keys}
    base = master.node.master.outer_step
    blob = encode_delta(delta, DeltaInfo("w", 3, base, "x"), layout)
    path = delta_path("w", 3, parse_header(blob).metadata["sha256"])
    hub.put(path, blob)
    first = master.node.master.sync_once()
    assert first.included == 1
    hub.put(path, blob)  # re-uploaded after it was applied and removed
    second = master.node.master.sync_once()
    assert (second.included, second.published) == (0, False)
    assert hub.get(path) is None  # cleaned up
    # Same name stem, new content (from another incarnation of "w": a second delta of the
    # same incarnation for step 3 would repeat applied steps, an ``overlap`` rejection).
    other = encode_delta({k: v * 2 for k, v in delta.items()}, DeltaInfo("w", 3, base, "y"), layout)
    hub.put(delta_path("w", 3, parse_header(other).metadata["sha256"]), other)
    assert master.node.master.sync_once().included == 1
    stop(master)
