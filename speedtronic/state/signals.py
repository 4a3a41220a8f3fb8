"""How a fit stopped by a signal says so: its stop reason and the process's exit status.

The checkpoint callback saves and stops the fit when SIGTERM or SIGINT arrives, with the
stop reason ``signal_stop_reason`` gives; the CLI turns that reason back into the shell's
exit status for the signal (``requeue_exit_code``), so a scheduler sees an interrupted job
it may requeue, not a finished or a failed one.
"""

from __future__ import annotations

import signal

from speedtronic.state.time_budget import TIME_BUDGET_EXIT_CODE, is_time_budget_stop

__all__ = ["bad_input_stop_reason", "requeue_exit_code", "signal_stop_reason", "stop_exit_code"]

_SIGNAL_REASON_PREFIX = "signal "
_BAD_INPUT_PREFIX = "bad input: "

_BAD_INPUT_EXIT_CODE = 2
"""The exit status of a run a plugin stopped because its input is bad (a loss that keeps
spiking, say): the status of every other user mistake, so a wrapper does not requeue it."""


def signal_stop_reason(received: signal.Signals) -> str:
    """The stop reason of a fit stopped by ``received`` (``"signal SIGTERM"``), in the form
    ``requeue_exit_code`` reads back."""
    return f"{_SIGNAL_REASON_PREFIX}{received.name}"


def requeue_exit_code(stop_reason: str | None) -> int | None:
    """The exit status for a fit stopped by a signal (``"signal SIGTERM"`` -> 143, SIGINT ->
    130: the shell's 128 + signal number), or ``None`` when it was not stopped by one.

    The checkpoint callback stops the fit with such a reason after saving; a launcher that
    exits with this status tells a scheduler the job was interrupted, not finished (0) and
    not failed (1), so it can be requeued and resumed with ``--resume``. A fit that spent
    its time budget (``speedtronic.state.time_budget``) exits ``TIME_BUDGET_EXIT_CODE`` (75).
    """
    if is_time_budget_stop(stop_reason):
        return TIME_BUDGET_EXIT_CODE
    if not stop_reason or not stop_reason.startswith(_SIGNAL_REASON_PREFIX):
        return None
    name = stop_reason.removeprefix(_SIGNAL_REASON_PREFIX).strip()
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return None


def bad_input_stop_reason(message: str) -> str:
    """The stop reason of a fit a plugin stopped cleanly (after the step, so the checkpoint
    callback keeps the last good weights) because its data or settings are at fault; the
    CLI exits ``_BAD_INPUT_EXIT_CODE`` after it (``stop_exit_code``)."""
    return f"{_BAD_INPUT_PREFIX}{message}"


def stop_exit_code(stop_reason: str | None) -> int | None:
    """The exit status a fit's stop reason asks for: a requeue status (signal, time budget,
    ``requeue_exit_code``), ``_BAD_INPUT_EXIT_CODE`` after a bad-input stop, else ``None``."""
    if stop_reason and stop_reason.startswith(_BAD_INPUT_PREFIX):
        return _BAD_INPUT_EXIT_CODE
    return requeue_exit_code(stop_reason)
