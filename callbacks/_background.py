"""A single background thread that hands items to a slow client in order.

Some clients block the caller for a while per call (``wandb.log`` waits for its service
round trip, ~0.2 ms). Sinks submit records here instead, so the training thread only pays
for a queue put. Items are handled in submission order; the queue is bounded, so a client
slower than training applies back-pressure instead of growing memory without limit.

A failure in the worker is kept and raised from the next ``submit`` (or from ``close``),
so it surfaces in the training thread where the observer guard reports it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundWorker(Generic[T]):
    """Runs ``handle(item)`` for every submitted item on one daemon thread."""

    def __init__(self, name: str, handle: Callable[[T], None], max_pending: int = 10_000) -> None:
        self._handle = handle
        # ``(item,)`` for work, ``None`` to stop: the tuple keeps the item's type for mypy.
        self._queue: queue.Queue[tuple[T] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._handle(item[0])
            except Exception as exc:  # kept for the training thread to report
                with self._lock:
                    if self._error is None:
                        self._error = exc
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def submit(self, item: T) -> None:
        """Queue ``item``; raises the worker's first failure since the last report."""
        if self._closed:
            raise RuntimeError("submit() on a closed BackgroundWorker")
        self._raise_pending()
        self._queue.put((item,))

    def drain(self) -> None:
        """Wait until every submitted item was handled; raise a pending failure."""
        if not self._closed:
            self._queue.join()
        self._raise_pending()

    def close(self, timeout: float | None = 60.0) -> None:
        """Handle what is queued, stop the thread, and raise a pending failure."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout)
        self._raise_pending()
