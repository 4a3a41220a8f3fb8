"""A background thread that hands items to a slow client, in order, in batches.

Some clients cost the caller a lot per call: ``wandb.log`` waits for its service round trip
(~0.2 ms), TensorBoard's writer hands every event to its own thread through a locked queue.
Sinks submit records here instead. ``submit`` is a ``deque.append`` -- no lock, no thread
wake-up -- and the worker wakes every ``interval_s`` (or when asked to drain) to handle
everything pending. Waking a thread per record would make the training thread pay for a
lock hand-off on every logged step, which on a machine with busy cores can take
milliseconds.

The number of pending items is bounded (``max_pending``): a client slower than training
applies back-pressure instead of growing memory without limit. A failure in the worker is
kept and raised from the next ``submit``, ``drain`` or ``close``, so it surfaces in the
training thread where the observer guard reports it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundWorker(Generic[T]):
    """Runs ``handle(item)`` for every submitted item on one daemon thread."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], None],
        *,
        interval_s: float = 0.1,
        max_pending: int = 10_000,
    ) -> None:
        self._handle = handle
        self._interval_s = interval_s
        self._max_pending = max_pending
        self._pending: deque[T] = deque()
        self._submitted = 0  # written by the submitting thread only
        self._handled = 0  # written by the worker only
        self._progress = threading.Condition()
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- worker side --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            stopping = self._stopping  # read before draining: nothing is left behind
            self._handle_pending()
            if stopping:
                return

    def _handle_pending(self) -> None:
        while self._pending:
            item = self._pending.popleft()
            try:
                self._handle(item)
            except Exception as exc:  # kept for the training thread to report
                if self._error is None:
                    self._error = exc
            self._handled += 1
        with self._progress:
            self._progress.notify_all()

    # -- caller side --------------------------------------------------------------------

    def _raise_pending_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _wait_until_handled(self, count: int) -> None:
        with self._progress:
            while self._handled < count and self._thread.is_alive():
                self._wake.set()
                self._progress.wait(self._interval_s)

    def submit(self, item: T) -> None:
        """Queue ``item``; raises the worker's first failure since the last report."""
        if self._stopping:
            raise RuntimeError("submit() on a closed BackgroundWorker")
        self._raise_pending_error()
        if len(self._pending) >= self._max_pending:  # back-pressure
            self._wait_until_handled(self._submitted - self._max_pending // 2)
        self._pending.append(item)
        self._submitted += 1

    def drain(self) -> None:
        """Wait until every item submitted so far was handled; raise a pending failure."""
        self._wait_until_handled(self._submitted)
        self._raise_pending_error()

    def close(self, timeout: float | None = 60.0) -> None:
        """Handle what is pending, stop the thread, and raise a pending failure."""
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout)
        self._raise_pending_error()
