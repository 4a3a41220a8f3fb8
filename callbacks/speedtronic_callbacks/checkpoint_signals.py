"""How the ``checkpoint`` callback handles SIGTERM and SIGINT (``save_on_signal``).

The first SIGTERM or SIGINT asks the trainer to stop after the current step
(``trainer.request_stop("signal SIGTERM")``); the fit then ends normally,
the final checkpoint is written, and ``TrainResult.stop_reason`` says which signal it was
(``speedtronic.state.checkpoint.requeue_exit_code`` maps it to the exit status 128 + signal
number). A second signal is handled the way it was before the fit (Ctrl-C twice interrupts
at once) -- except while a checkpoint is being written (or waited for): cut short there,
torch's archive writer turned the interrupt into a "could not write" error. Then the save
goes on, and the signal is handed over as soon as the checkpoint is on disk (it is the
resume point); a third signal abandons the save at once (its temp file removed, the
previous checkpoint stays the resume point), and the run ends as interrupted either way,
never with a checkpoint error. The previous handlers are restored at ``teardown``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from speedtronic.state.checkpoint import CheckpointError, signal_stop_reason

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["SaveSignals"]

logger = logging.getLogger("speedtronic.checkpoint")

_HANDLED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
_SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None
"""What ``signal.signal`` returns: the handler that was installed before."""


class SaveSignals:
    """The signal handling of one fit: installed at setup, restored at teardown (or when a
    signal is handed over)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        """The first SIGTERM/SIGINT of the fit (it asked the trainer to stop)."""
        self.abandoned = False
        """A third signal cut a checkpoint write short."""
        self._previous: dict[signal.Signals, _SignalHandler] = {}
        self._writing = False  # the main thread writes (or waits for) a checkpoint
        self._deferred: signal.Signals | None = None  # a second signal, held until written

    def reset(self) -> None:
        """A new fit: no signal received yet."""
        self.received = None
        self._deferred, self.abandoned = None, False

    @contextlib.contextmanager
    def writing_checkpoint(self) -> Iterator[None]:
        """Around a checkpoint write (or a wait for one) on the main thread: a second signal
        meanwhile is held until the write is done, then handed over; a third abandons it,
        and the error torch makes of the interrupt is the interrupt again."""
        self._writing = True
        try:
            yield
        except CheckpointError:
            if self.abandoned:
                raise KeyboardInterrupt from None  # what the abandoned save was cut by
            raise
        finally:
            self._writing = False
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self.hand_over(deferred, None)

    def hand_over(self, received: signal.Signals, frame: FrameType | None) -> None:
        """Give ``received`` to whoever handled it before the fit (restoring them all)."""
        previous = self._previous.get(received)
        self.restore()
        if callable(previous):
            # Call it here, in this frame: re-raising the signal from inside a handler
            # leaves *when* the old handler runs to the interpreter.
            previous(int(received), frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(received)  # the default action (terminate)

    def install(self, trainer: TrainerView) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.info("not in the main thread: SIGTERM/SIGINT handling left to the caller")
            return

        def handle(signum: int, frame: FrameType | None) -> None:
            received = signal.Signals(signum)
            if self.received is not None:
                if self._writing and self._deferred is None:
                    self._deferred = received
                    logger.warning(
                        "received %s again while a checkpoint is being written: stopping as "
                        "soon as it is on disk (send it once more to abandon the save)",
                        received.name,
                    )
                    return
                # Ctrl-C twice (or three times during a save): hand it over at once.
                self.abandoned = self._writing
                self.hand_over(received, frame)
                return
            self.received = received
            trainer.request_stop(signal_stop_reason(received))
            if trainer.multi_rank:
                # The signal reaches the ranks at different moments: one that gets it just
                # after casting its vote at a logging step still stops there when another
                # rank voted to stop, so this rank can only name the latest step.
                logger.warning(
                    "received %s: stopping with the other ranks at their next agreed "
                    "logging step (step %d at the latest) and saving a checkpoint "
                    "(send it again to stop immediately)",
                    received.name,
                    _latest_stop_step(trainer),
                )
                return
            logger.warning(
                "received %s: stopping after step %d and saving a checkpoint "
                "(send it again to stop immediately)",
                received.name,
                trainer.step_in_progress,
            )

        for sig in _HANDLED_SIGNALS:
            self._previous[sig] = signal.signal(sig, handle)

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if handler is None:  # installed from C; we cannot put it back, use the default
                handler = signal.SIG_DFL
            signal.signal(sig, handler)


def _latest_stop_step(trainer: TrainerView) -> int:
    """The latest step a stop requested now on one rank of several ends after: the ranks
    agree on stopping at logging steps only (``Trainer.fit``), so the first logging step from
    the step in progress (a multiple of ``metrics_every`` or of ``eval_every``, or the target
    step). It is earlier when another rank asked first."""
    step = trainer.step_in_progress
    cadences = [every for every in (trainer.metrics_every, trainer.eval_every) if every > 0]
    return min([trainer.target_step, *(-(-step // every) * every for every in cadences)])
