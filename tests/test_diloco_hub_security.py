"""The hub as an attack surface (issue 12, items 4, 5 and 11): replayed files never roll
the master or a node back, crafted files are logged rejections that never stop a round,
and a junk pointer pauses aggregation only until it is valid again."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.master import (
    MasterLoop,
    MasterSettings,
    RoundReport,
    delta_path,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.pointer import (
    POINTER_PATH,
    decode_pointer,
    model_file_name,
    outer_file_name,
)
from speedtronic_callbacks.diloco.transport_base import (
    RetryingTransport,
    RetryPolicy,
    UnreadableFileError,
)
from speedtronic_callbacks.diloco.wire import DeltaInfo, RejectionReason, encode_delta, parse_header

SECRET = b"shared secret"


def make_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def layout_of_model() -> ModelLayout:
    return build_layout(make_model().state_dict())


def retrying(hub: DirectoryTransport) -> RetryingTransport:
    policy = RetryPolicy(attempts=2, initial=0.001, maximum=0.001, timeout=10)
    return RetryingTransport(hub, policy, sleep=lambda _: None)


def make_master(hub: DirectoryTransport, **settings: object) -> MasterLoop:
    master = MasterLoop(
        retrying(hub),
        layout_of_model(),
        MasterSettings(node_id="master", secret=SECRET, **settings),  # type: ignore[arg-type]  # test knobs
    )
    master.reconcile(make_model().state_dict())
    return master


def put_delta(
    hub: DirectoryTransport, node: str, step: int, base: int, value: float | None = None
) -> str:
    """A valid, signed delta from ``node`` made at local ``step`` on global ``base`` (its
    values depend on the step, so that deltas differ in content)."""
    layout = layout_of_model()
    fill = 1e-4 * step if value is None else value
    delta = {key: torch.full(layout.wire_shapes[key], fill) for key in layout.sync_keys}
    blob = encode_delta(delta, DeltaInfo(node, step, base, "inc"), layout, secret=SECRET)
    path = delta_path(node, step, parse_header(blob).metadata["sha256"])
    hub.put(path, blob)
    return path


def hub_step(hub: DirectoryTransport) -> int:
    raw = hub.get(POINTER_PATH)
    assert raw is not None
    return decode_pointer(raw, fingerprint=layout_of_model().fingerprint, secret=SECRET).outer_step


def advance(master: MasterLoop, hub: DirectoryTransport, rounds: int, first_step: int) -> None:
    for offset in range(rounds):
        put_delta(hub, "worker", first_step + offset, master.outer_step)
        assert master.sync_once().published


def global_files(root: Path, step: int) -> dict[str, bytes]:
    names = (POINTER_PATH, model_file_name(step), outer_file_name(step))
    return {name: (root / name).read_bytes() for name in names}


@pytest.fixture(autouse=True)
def _release_masters() -> None:
    MasterLoop._active.clear()


# -- item 4: replayed, validly signed files ------------------------------------------------


def test_a_replayed_pointer_never_rolls_the_master_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = make_master(hub)
    advance(master, hub, rounds=1, first_step=1)
    saved = global_files(tmp_path / "hub", 1)  # copied aside at outer step 1
    advance(master, hub, rounds=40, first_step=2)
    assert master.outer_step == 41
    for name, data in saved.items():  # ... and put back 40 outer steps later
        hub.put(name, data)

    put_delta(hub, "worker", 100, base=41)
    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        report = master.sync_once()

    assert report.published and report.outer_step == 42
    assert [r.reason for r in report.rejected] == []  # no future_base deadlock
    assert hub_step(hub) == 42
    assert "rejected the hub pointer at outer step 1" in caplog.text
    assert master.halted is None


def test_a_replayed_pointer_between_rounds_is_overwritten_with_the_current_step(
    tmp_path: Path,
) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = make_master(hub)
    advance(master, hub, rounds=1, first_step=1)
    saved = global_files(tmp_path / "hub", 1)
    advance(master, hub, rounds=3, first_step=2)
    for name, data in saved.items():
        hub.put(name, data)

    report = master.sync_once()  # no deltas waiting: nothing to aggregate

    assert not report.published
    assert master.outer_step == 4 and hub_step(hub) == 4
    assert not (tmp_path / "hub" / model_file_name(1)).exists()  # the replayed files go


def make_worker(hub: DirectoryTransport) -> DiLoCoNode:
    model = make_model()
    return DiLoCoNode(
        model,
        retrying(hub),
        build_layout(model.state_dict()),
        NodeSettings(
            node_id="worker", role="worker", inner_steps=1000, poll_interval=0.0, secret=SECRET
        ),
    )


def poll_and_install(node: DiLoCoNode, step: int) -> None:
    node.on_step(step)  # schedules a poll
    assert node.wait_idle(10)
    node.on_step(step + 1)  # installs what the poll fetched
    assert node.wait_idle(10)


def test_a_node_never_installs_an_older_global(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    master = make_master(hub)
    advance(master, hub, rounds=1, first_step=1)
    saved = global_files(tmp_path / "hub", 1)
    advance(master, hub, rounds=3, first_step=2)
    node = make_worker(hub)
    node.start(0)
    assert node.wait_idle(10)
    poll_and_install(node, 1)
    assert node.installed_step == 4
    for name, data in saved.items():
        hub.put(name, data)

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        poll_and_install(node, 3)

    assert node.installed_step == 4
    assert "rejected the hub pointer at outer step 1" in caplog.text
    advance(master, hub, rounds=1, first_step=10)  # the master puts a newer step out
    poll_and_install(node, 5)
    assert node.installed_step == 5
    node.stop()


# -- item 5: crafted files -----------------------------------------------------------------


def crafted_path(step: int) -> str:
    return f"nodes/evil/delta_{step}_{step:016x}.safetensors"


def deep_header_file() -> bytes:
    header = b"[" * 100_000 + b"]" * 100_000
    return len(header).to_bytes(8, "little") + header


def test_crafted_files_are_rejections_and_the_round_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    master = make_master(hub)
    honest = put_delta(hub, "honest", 1, base=0)
    deep = crafted_path(1)
    hub.put(deep, deep_header_file())
    fifo = root / crafted_path(2)
    os.mkfifo(fifo)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((root / honest).read_bytes())
    os.symlink(outside, root / crafted_path(3))
    sparse = root / crafted_path(4)
    with open(sparse, "wb") as handle:
        handle.truncate(2 << 30)  # 2 GB, no blocks on disk
    hub.put(crafted_path(5), (2**40).to_bytes(8, "little") + b"{}")  # a header length lie
    threads = threading.active_count()

    started = time.monotonic()
    report = master.sync_once()

    assert time.monotonic() - started < 10
    assert report.published and [a.path for a in report.applied] == [honest]
    reasons = {r.path: r.reason for r in report.rejected}
    assert reasons == {
        deep: RejectionReason.CORRUPT,
        crafted_path(2): RejectionReason.UNSAFE_FILE,
        crafted_path(3): RejectionReason.UNSAFE_FILE,
        crafted_path(4): RejectionReason.TOO_LARGE,
        crafted_path(5): RejectionReason.CORRUPT,
    }
    assert threading.active_count() == threads  # no reader left blocked on the FIFO
    assert all((root / path).exists() or (root / path).is_symlink() for path in reasons)

    second = master.sync_once()  # examined once: not read again while unchanged
    assert second.rejected == () and not second.published


def test_a_folder_linked_out_of_the_hub_is_neither_read_nor_written(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    master = make_master(hub)
    path = put_delta(hub, "linked", 1, base=0)
    outside = tmp_path / "elsewhere"
    (root / "nodes" / "linked").rename(outside)
    os.symlink(outside, root / "nodes" / "linked")
    before = sorted(p.name for p in outside.iterdir())

    report = master.sync_once()

    assert report.applied == () and not report.published  # never followed
    with pytest.raises(UnreadableFileError, match="symbolic link"):
        hub.get(path)
    with pytest.raises(UnreadableFileError, match="symbolic link"):
        hub.put("nodes/linked/delta_2_0000000000000000.safetensors", b"x")
    assert sorted(p.name for p in outside.iterdir()) == before


# -- item 5: a junk pointer pauses aggregation only while it is junk ----------------------


@pytest.mark.parametrize(
    "junk",
    [b"{not json", b"[" * 100_000, b'{"format": "speedtronic-diloco/1"}', "fifo"],
    ids=["garbage", "deep", "incomplete", "fifo"],
)
def test_a_junk_pointer_pauses_the_master_until_it_is_valid_again(
    tmp_path: Path, junk: bytes | str
) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    master = make_master(hub)
    advance(master, hub, rounds=2, first_step=1)
    valid = (root / POINTER_PATH).read_bytes()
    (root / POINTER_PATH).unlink()
    if junk == "fifo":
        os.mkfifo(root / POINTER_PATH)
    else:
        assert isinstance(junk, bytes)
        (root / POINTER_PATH).write_bytes(junk)
    put_delta(hub, "worker", 10, base=2)

    paused: RoundReport = master.sync_once()

    assert paused.paused is not None and not paused.published
    assert master.halted is None and master.outer_step == 2
    (root / POINTER_PATH).unlink()
    hub.put(POINTER_PATH, valid)
    resumed = master.sync_once()
    assert resumed.published and resumed.outer_step == 3 and resumed.paused is None


# -- item 11: a rejected delta stays on the hub ---------------------------------------------


def test_a_rejected_delta_stays_even_when_named_after_an_applied_hash(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    master = make_master(hub)
    applied = put_delta(hub, "worker", 1, base=0)
    assert master.sync_once().published
    assert not (root / applied).exists()  # applied deltas are removed
    prefix = applied.rsplit("_", 1)[1].removesuffix(".safetensors")
    forged = f"nodes/worker/delta_2_{prefix}.safetensors"
    hub.put(forged, b"not a delta, named like an applied one")
    replayed = f"nodes/worker/delta_3_{prefix}.safetensors"
    other = put_delta(hub, "worker", 3, base=1, value=2e-3)  # valid, another hash
    (root / other).rename(root / replayed)

    report = master.sync_once()

    assert {r.path: r.reason for r in report.rejected} == {
        forged: RejectionReason.CORRUPT,
        replayed: RejectionReason.NAME_MISMATCH,
    }
    assert (root / forged).exists() and (root / replayed).exists()


def test_a_reuploaded_applied_delta_is_still_removed_as_a_duplicate(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    master = make_master(hub)
    applied = put_delta(hub, "worker", 1, base=0)
    data = (root / applied).read_bytes()
    assert master.sync_once().published
    hub.put(applied, data)  # a lost acknowledgement: the node sends it again

    report = master.sync_once()

    assert report.duplicates == 1 and report.rejected == () and not report.published
    assert not (root / applied).exists()


def test_a_restarted_master_without_checkpoint_ignores_a_replayed_pointer(
    tmp_path: Path,
) -> None:
    root = tmp_path / "hub"
    hub = DirectoryTransport(root)
    first = make_master(hub)
    advance(first, hub, rounds=1, first_step=1)
    saved = global_files(root, 1)
    advance(first, hub, rounds=4, first_step=2)
    first.release()
    for name, data in saved.items():  # the step-1 files put back ...
        hub.put(name, data)
    MasterLoop._active.clear()

    restarted = make_master(hub)  # ... while the master restarts with no checkpoint

    assert restarted.outer_step == 5 and hub_step(hub) == 5
    put_delta(hub, "worker", 50, base=5)
    report = restarted.sync_once()
    assert report.published and report.outer_step == 6 and report.rejected == ()
