"""Bounded background I/O: each lane runs at most one job at a time and never queues (a
``speedtronic.util.worker.BackgroundWorker`` that refuses while busy).

The training thread hands work to a lane with ``try_submit``; if the lane is still busy
with the previous job the call returns ``False`` at once and the caller carries on (a
skipped upload is folded into the next, cumulative one). Jobs report back through an
``Inbox`` that the training thread drains at its next synchronisation point, so the live
model is only ever touched on the training thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from speedtronic.util.worker import BackgroundWorker, run_job
from speedtronic_callbacks.diloco.transport_base import HubNotCreatedError

T = TypeVar("T")

logger = logging.getLogger("speedtronic.diloco")


class Inbox(Generic[T]):
    """A thread-safe FIFO of results from background jobs to the training thread."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._lock = threading.Lock()

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)

    def drain(self) -> list[T]:
        """Everything delivered so far, oldest first (and empties the inbox)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class Lane:
    """One named background worker (``speedtronic.util.worker``) running at most one job
    at a time: ``try_submit`` refuses while a job runs.

    A job that raises is logged and counted (``failures``); the lane stays usable. After
    ``close`` the lane refuses work until ``open`` is called again (a later ``fit``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._open = True
        self._worker = self._new_worker()
        self._closing: BackgroundWorker[Callable[[], None]] | None = None
        """A closed worker whose job outlived ``close``: the lane is busy until it ends."""
        self.submitted = 0
        self.skipped = 0
        self.failures = 0

    def _new_worker(self) -> BackgroundWorker[Callable[[], None]]:
        return BackgroundWorker(
            f"speedtronic-diloco-{self.name}",
            run_job,
            max_pending=1,
            when_full="refuse",
            on_error=self._failed,
        )

    def _failed(self, error: BaseException) -> None:
        # A background failure must never kill the process: logged, counted, lane usable.
        with self._lock:
            self.failures += 1
        logger.error("diloco %s job failed", self.name, exc_info=error)

    @property
    def busy(self) -> bool:
        closing = self._closing
        return self._worker.busy or (closing is not None and closing.busy)

    def open(self) -> None:
        with self._lock:
            self._open = True
            if self._worker.closed:
                self._closing, self._worker = self._worker, self._new_worker()

    def try_submit(self, job: Callable[[], None]) -> bool:
        """Start ``job`` in the background unless a job is still running (then ``False``)."""
        with self._lock:
            if not self._open or self.busy or not self._worker.submit(job):
                self.skipped += 1
                return False
            self.submitted += 1
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is running (``True``) or ``timeout`` passes (``False``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        closing = self._closing
        if closing is not None and not closing.drain(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._worker.drain(left)

    def close(self, timeout: float) -> bool:
        """Refuse new jobs and wait up to ``timeout`` s for the running one; ``True`` when
        the lane is idle. A job still running keeps going as a daemon thread."""
        with self._lock:
            self._open = False
        finished = self._worker.close(timeout)
        if not finished:
            logger.warning(
                "diloco %s lane still busy after %.1f s at shutdown; leaving it to finish in "
                "the background",
                self.name,
                timeout,
            )
        return finished


class ErrorReporter:
    """Reports failures of background I/O without flooding the log.

    A permanent error (bad token, missing repository, permission denied) is logged once at
    ERROR with its fix; a transient one once at WARNING per operation until that operation
    succeeds again, which is logged at INFO. Training never stops because of either.
    """

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._log = log or logger
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}
        self._permanent_seen: set[str] = set()
        self.errors = 0
        self.permanent_errors = 0
        self.last_error: str = ""

    def failure(self, operation: str, error: BaseException, *, permanent: bool) -> None:
        message = str(error)
        with self._lock:
            self.errors += 1
            self.last_error = message
            if permanent:
                self.permanent_errors += 1
                first = message not in self._permanent_seen
                self._permanent_seen.add(message)
            else:
                first = self._active.get(operation) != message
            self._active[operation] = message
        if first and isinstance(error, HubNotCreatedError):
            self._log.info(
                "diloco %s: waiting for the master to create the hub (%s); this node keeps "
                "training and syncs once it exists",
                operation,
                message,
            )
        elif permanent and first:
            self._log.error(
                "diloco %s failed permanently: %s -- local training continues; fix the "
                "cause and this node resumes syncing on its own",
                operation,
                message,
            )
        elif first:
            self._log.warning("diloco %s failed (will retry): %s", operation, message)

    def success(self, operation: str) -> None:
        with self._lock:
            previous = self._active.pop(operation, None)
        if previous is not None:
            self._log.info("diloco %s works again", operation)
