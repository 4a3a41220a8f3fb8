"""The one background worker: a daemon thread that handles submitted items in order.

Every piece of work the training thread hands off goes through ``BackgroundWorker``: the
asynchronous checkpoint writes (``speedtronic.state.checkpoint_async``), the object-store
uploads (``speedtronic.state.remote``), the metric sinks' client calls (TensorBoard, W&B) and
the DiLoCo lanes. They differ only in what a full queue means, which ``when_full`` says:

- ``"wait"``: ``submit`` blocks until the worker has caught up by half of ``max_pending``
  (back-pressure: a client slower than training does not grow memory without limit). Its
  ``submit`` is a ``deque.append`` with no lock and no thread wake-up when ``interval_s`` is
  set: the worker wakes every ``interval_s`` (or when asked to drain) and handles everything
  pending, so the training thread never pays a lock hand-off per logged step.
- ``"replace"``: a newer item replaces the oldest not yet started (only the newest matters:
  an upload of the newest checkpoint supersedes one still waiting); ``dropped`` counts them.
  The item being handled is never interrupted.
- ``"refuse"``: ``submit`` returns ``False`` at once while ``max_pending`` items are
  unfinished (the one being handled included); ``refused`` counts them. A DiLoCo lane runs
  one job at a time and folds a skipped upload into the next.

A failure of ``handle`` never ends the thread. With ``on_error`` it is reported there (on the
worker thread); otherwise the first one is kept and raised by the next ``drain`` or ``close``
-- and by ``submit`` under ``"wait"``, the one policy whose ``submit`` may block anyway -- so
that it surfaces on the submitting thread. ``close`` handles what is pending and stops the
thread; a closed worker refuses work (``RuntimeError``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

__all__ = ["BackgroundWorker", "run_job"]

T = TypeVar("T")
_WhenFull = Literal["wait", "replace", "refuse"]

_POLL_S = 0.1
"""How often a waiting caller checks that the worker thread is still alive."""


def run_job(job: Callable[[], None]) -> None:
    """The ``handle`` of a worker whose items are jobs (functions of no arguments)."""
    job()


class BackgroundWorker(Generic[T]):
    """Runs ``handle(item)`` for every submitted item on one daemon thread, in order
    (module docstring). The thread starts with the first ``submit``."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], None],
        *,
        max_pending: int = 10_000,
        when_full: _WhenFull = "wait",
        interval_s: float | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self._handle = handle
        self._max_pending = max_pending
        self._when_full: _WhenFull = when_full
        self._interval_s = interval_s
        self._on_error = on_error
        self._pending: deque[T] = deque()
        self._submitted = 0  # "wait": written by the submitting thread only
        self._handled = 0  # written by the worker only
        self._condition = threading.Condition()
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Items replaced by a newer one before they started (``"replace"``)."""
        self.refused = 0
        """Items refused because the worker was full (``"refuse"``)."""

    # -- worker side --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            stopping = self._stopping  # read before handling: nothing is left behind
            self._handle_pending()
            if stopping:
                return

    def _handle_pending(self) -> None:
        # Under "wait" this thread is the only one taking items (a deque's popleft is
        # atomic) and the only writer of _handled: no lock per item, one notify per batch,
        # so a batch costs the submitting thread no GIL time beyond the handling itself.
        # The other policies take items out of the queue on the submitting side too.
        locked = self._when_full != "wait"
        while True:
            if locked:
                with self._condition:
                    if not self._pending:
                        break
                    item = self._pending.popleft()
            elif self._pending:
                item = self._pending.popleft()
            else:
                break
            try:
                self._handle(item)
            except BaseException as exc:  # the thread goes on; the failure is reported
                self._report(exc)
            self._handled += 1
        with self._condition:
            self._condition.notify_all()

    def _report(self, error: BaseException) -> None:
        if self._on_error is None:
            if self._error is None:
                self._error = error
            return
        try:
            self._on_error(error)
        except Exception as exc:  # a broken reporter must not end the thread either
            if self._error is None:
                self._error = exc

    # -- caller side --------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether an item is being handled or waiting."""
        with self._condition:
            return self._handled < self._submitted

    @property
    def closed(self) -> bool:
        return self._stopping

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _raise_pending_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _wait_until_handled(self, count: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._handled < count:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    return False
                self._wake.set()  # a worker on an interval handles what is pending now
                remaining = _POLL_S if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._condition.wait(min(remaining, _POLL_S))
        return True

    def submit(self, item: T) -> bool:
        """Hand ``item`` to the worker; ``False`` only when ``"refuse"`` refused it."""
        if self._stopping:
            raise RuntimeError(f"{self.name}: submit() on a closed BackgroundWorker")
        if self._when_full == "wait":  # the sinks' per-record path: kept to a few reads
            if self._error is not None:
                self._raise_pending_error()
            if self._thread is None:
                self._start()
            if len(self._pending) >= self._max_pending:  # back-pressure
                self._wait_until_handled(self._submitted - self._max_pending // 2, None)
            self._pending.append(item)
            self._submitted += 1
            if self._interval_s is None:
                self._wake.set()
            return True
        with self._condition:
            if self._when_full == "refuse":
                if self._submitted - self._handled >= self._max_pending:
                    self.refused += 1
                    return False
            else:
                while len(self._pending) >= self._max_pending:
                    self._pending.popleft()
                    self._submitted -= 1
                    self.dropped += 1
            self._pending.append(item)
            self._submitted += 1
            if self._thread is None:
                self._start()
        self._wake.set()
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every item submitted so far was handled (``False`` when ``timeout``
        seconds passed first); raise a pending failure."""
        with self._condition:
            count = self._submitted
        idle = self._wait_until_handled(count, timeout)
        self._raise_pending_error()
        return idle

    def close(self, timeout: float | None = 60.0) -> bool:
        """Handle what is pending and stop the thread, waiting up to ``timeout`` seconds
        (``False`` when it is still running then: it finishes as a daemon); raise a pending
        failure."""
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join(timeout)
        finished = self._thread is None or not self._thread.is_alive()
        self._raise_pending_error()
        return finished
