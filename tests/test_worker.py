"""The one background worker (``speedtronic.util.worker``): order, draining, failures, and
the three policies for a full queue its users rely on -- back-pressure (metric sinks,
checkpoint writes), the newest replaces what waits (object-store uploads), refuse while busy
(DiLoCo lanes). Waits are bounded by events, never by timing."""

from __future__ import annotations

import threading

import pytest

from speedtronic.util.worker import BackgroundWorker


def test_background_worker_keeps_order_drains_and_reports_failures() -> None:
    handled: list[int] = []

    def handle(item: int) -> None:
        if item == 3:
            raise ValueError("item 3 is bad")
        handled.append(item)

    worker: BackgroundWorker[int] = BackgroundWorker(
        "test-worker", handle, max_pending=4, interval_s=0.1
    )
    for item in range(3):
        worker.submit(item)
    worker.drain()
    assert handled == [0, 1, 2]
    worker.submit(3)
    with pytest.raises(ValueError, match="item 3 is bad"):
        worker.drain()
    for item in range(4, 20):  # more than max_pending: submit waits instead of growing
        worker.submit(item)
    worker.close()
    assert handled == [0, 1, 2, *range(4, 20)]
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(99)


class Gate:
    """A job that blocks until released, recording what ran."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.ran: list[str] = []

    def handle(self, item: str) -> None:
        if item == "slow":
            self.started.set()
            assert self.release.wait(10)
        self.ran.append(item)


def test_replace_keeps_only_the_newest_waiting_item_and_never_blocks() -> None:
    gate = Gate()
    worker: BackgroundWorker[str] = BackgroundWorker(
        "test-latest", gate.handle, max_pending=1, when_full="replace"
    )
    worker.submit("slow")
    assert gate.started.wait(10) and worker.busy
    for item in ("a", "b", "c"):  # the one being handled is never interrupted
        assert worker.submit(item)
    gate.release.set()
    assert worker.drain(10) and not worker.busy
    assert gate.ran == ["slow", "c"] and worker.dropped == 2
    assert worker.close(10)


def test_refuse_answers_false_while_busy_and_on_error_keeps_the_thread() -> None:
    gate = Gate()
    errors: list[str] = []

    def handle(item: str) -> None:
        if item == "bad":
            raise RuntimeError("bad job")
        gate.handle(item)

    worker: BackgroundWorker[str] = BackgroundWorker(
        "test-lane",
        handle,
        max_pending=1,
        when_full="refuse",
        on_error=lambda error: errors.append(str(error)),
    )
    assert worker.submit("slow") and gate.started.wait(10)
    assert not worker.submit("skipped") and worker.refused == 1
    gate.release.set()
    assert worker.drain(10)
    assert worker.submit("bad") and worker.drain(10)  # reported, not raised
    assert errors == ["bad job"]
    assert worker.submit("after") and worker.close(10)
    assert gate.ran == ["slow", "after"]


def test_a_drain_or_close_that_times_out_says_so() -> None:
    gate = Gate()
    worker: BackgroundWorker[str] = BackgroundWorker("test-timeout", gate.handle)
    worker.submit("slow")
    assert gate.started.wait(10)
    assert not worker.drain(0.05)
    assert not worker.close(0.05)  # the item goes on as a daemon
    gate.release.set()
    assert worker.drain(10) and gate.ran == ["slow"]
