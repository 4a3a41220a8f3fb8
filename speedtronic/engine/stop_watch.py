"""A requested stop happens within a bounded time, even while the loop waits for data.

A stop request (``Trainer.request_stop``: the checkpoint plugin's SIGTERM/SIGINT handler,
early stopping, ...) takes effect after the current step. That step may be waiting for a
batch that never comes: a dataset whose ``__iter__`` hangs, a DataLoader worker stuck in the
dataset's code. Left alone, SIGTERM would then do nothing at all.

``StopWatch`` bounds that wait -- and the same wait in an evaluation step, for a held-out
batch (the held-out set is read through a ``DataPass``). The first stop request made on the
main thread while a fit runs there arms it: from then on a watch thread looks at the main
thread's stack a few times a second (``sys._current_frames``) -- nothing runs per step, and
nothing at all before a stop is requested. When the loop has been waiting for the same batch
(training or held-out) for ``grace_s`` seconds after the request (``Trainer.stop_grace_s``,
default ``STOP_GRACE_S``), the watch sends ``SIGALRM`` to the main thread alone
(``pthread_kill``), whose handler raises ``StopTimeoutError`` out of the wait. The fit then
fails like any other (``exception`` and ``teardown`` run, the error propagates): the step in
progress is incomplete, so no final checkpoint is written -- the newest periodic checkpoint
is where ``--resume`` continues. The trainer stops the worker processes of the data it gave
up on at once (``BatchStream.abandon``, ``DataPass.abandon``).

A step that is computing, not waiting for data, is never interrupted (it ends, and the stop
takes effect). The watch is disarmed as soon as the loop ends, so the final checkpoint's
save is never cut short. Only a wait that a signal can interrupt (sleeping, a queue, a
socket, a lock) can be abandoned. The ``SIGALRM`` handler is installed only while armed
(an alarm that is not the watch's goes to the previous handler) and restored afterwards.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from speedtronic.data.stream import BatchStream, DataPass

__all__ = ["STOP_GRACE_S", "StopTimeoutError", "StopWatch"]

STOP_GRACE_S = 10.0
"""Seconds a requested stop waits for a batch that does not come before giving up on it."""

_TRAINING_FETCH = BatchStream.__next__.__code__
_HELD_OUT_FETCH = DataPass.__next__.__code__
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
_Position = tuple[object, ...]
"""Which batch the main thread waits for: the training stream's position, or the held-out
pass and its count."""


class StopTimeoutError(RuntimeError):
    """A stop was requested, but the batch the step was waiting for did not come within the
    grace period; the step was abandoned."""


def _fetch_in(frame: FrameType | None) -> CodeType | None:
    """The data-fetching code (``BatchStream.__next__`` or ``DataPass.__next__``) that
    ``frame`` (the main thread's current frame) is inside, if any."""
    while frame is not None:
        if frame.f_code is _TRAINING_FETCH or frame.f_code is _HELD_OUT_FETCH:
            return frame.f_code
        frame = frame.f_back
    return None


class StopWatch:
    """Armed by a stop request; raises ``StopTimeoutError`` out of a data wait that outlasts
    ``grace_s`` (module docstring). ``disarm`` ends it; ``fired`` says whether it gave up.
    ``held_out`` says which ``DataPass`` an evaluation reads now (``None``: none)."""

    def __init__(
        self,
        stream: BatchStream[object],
        grace_s: float,
        reason: str,
        step: int,
        held_out: Callable[[], DataPass[object] | None] = lambda: None,
    ):
        self.stream = stream
        self.held_out = held_out
        self.grace_s = grace_s
        self.reason = reason
        self.step = step
        self.fired = False
        self._waiting: _Position | None = None  # the awaited batch
        self._since = 0.0
        self._done = threading.Event()
        self._previous_handler: _Handler = None
        self._thread: threading.Thread | None = None

    @classmethod
    def arm(
        cls,
        stream: BatchStream[object],
        grace_s: float,
        reason: str,
        step: int,
        held_out: Callable[[], DataPass[object] | None] = lambda: None,
    ) -> StopWatch | None:
        """Start watching, or ``None`` off the main thread or without ``pthread_kill``."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if not hasattr(signal, "pthread_kill"):  # Windows
            return None
        watch = cls(stream, grace_s, reason, step, held_out)
        # Requested from inside a wait (a signal handler runs on top of it): it counts from now.
        watch._waited(sys._getframe(1))
        watch._previous_handler = signal.signal(signal.SIGALRM, watch._on_alarm)
        watch._thread = threading.Thread(
            target=watch._watch, name="speedtronic-stop-watch", daemon=True
        )
        watch._thread.start()
        return watch

    def _position(self, frame: FrameType | None) -> _Position | None:
        """The batch the main thread waits for now (``None``: it waits for no data)."""
        fetch = _fetch_in(frame)
        if fetch is _TRAINING_FETCH:
            return ("training", self.stream.epoch, self.stream.batches_in_epoch)
        held_out = self.held_out() if fetch is _HELD_OUT_FETCH else None
        return None if held_out is None else ("held-out", id(held_out), held_out.batches)

    def _waited(self, frame: FrameType | None) -> float:
        """How long the main thread has been waiting for the batch it waits for now."""
        now = time.monotonic()
        position = self._position(frame)
        if position is None:
            self._waiting = None
            return 0.0
        if position != self._waiting:
            self._waiting, self._since = position, now
        return now - self._since

    def _watch(self) -> None:
        """On the watch thread: look at the main thread a few times a second (no signal is
        sent unless the wait has outlasted the grace, so nothing else is interrupted)."""
        main = threading.main_thread().ident
        assert main is not None
        poll = min(0.25, self.grace_s / 4)
        while not self._done.wait(poll):
            if self._waited(sys._current_frames().get(main)) >= self.grace_s:
                signal.pthread_kill(main, signal.SIGALRM)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        """In the main thread: give up on the batch, unless it came meanwhile (or the alarm
        was someone else's: it goes to the handler that was there before)."""
        waiting = self._waiting
        position = self._position(frame)
        if self._done.is_set() or waiting is None or position is None:
            if callable(self._previous_handler):
                self._previous_handler(signum, frame)
            return
        if position != waiting or time.monotonic() - self._since < self.grace_s:
            return  # the batch came meanwhile: this is a new wait
        self.disarm()
        self.fired = True
        awaited, loader = (
            ("the held-out batch its evaluation", "held-out data loader")
            if waiting[0] == "held-out"
            else ("the batch that step", "data loader")
        )
        raise StopTimeoutError(
            f"stop requested ({self.reason}) during step {self.step}, but {awaited} was "
            f"waiting for did not come within {self.grace_s:g} s: gave up on it (the {loader} "
            "hangs?). The step is incomplete, so no final checkpoint was written; the newest "
            "checkpoint is where a resumed run continues"
        )

    def disarm(self) -> None:
        """Stop watching and restore the previous ``SIGALRM`` handler (idempotent; main
        thread)."""
        if self._done.is_set():
            return
        self._done.set()
        previous = self._previous_handler
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if self._thread is not None:
            self._thread.join(timeout=5)  # it wakes at once: _done is set
