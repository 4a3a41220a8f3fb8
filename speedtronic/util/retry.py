"""The one retry policy of every store and hub: ``tenacity`` with jittered exponential backoff.

``Backoff`` says how often an operation is tried and how long to wait in between; ``retry``
runs an operation under it. The callers decide what is worth retrying (``retry_if``) and what
to raise when the tries run out (``give_up``); the waiting, the jitter and the counting are
here and nowhere else. The checkpoint mirror (``speedtronic.state.remote_store.Retry``) and the
DiLoCo hub (``speedtronic_callbacks.diloco.transport_base.RetryingTransport``) both run through
it.

Two jitters, because two kinds of callers want different spreads: ``full`` waits a random time
up to the capped exponential (``initial_s``, then up to twice that, ... at most ``max_s``), which
spreads a retry storm widest; ``equal`` waits between half of it and all of it, so a node's
retry never comes much sooner than its schedule says (DiLoCo nodes that failed together do not
retry together, and none hammers the hub early).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn, TypeVar

if TYPE_CHECKING:  # imported when an operation first runs: importing a store stays cheap
    from tenacity import RetryCallState

__all__ = ["Backoff", "retry"]

_Jitter = Literal["full", "equal"]
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class Backoff:
    """``attempts`` tries in total; before try ``n + 1`` a wait drawn from
    ``min(max_s, initial_s * 2**(n - 1))`` by ``jitter`` (module docstring)."""

    attempts: int
    initial_s: float
    max_s: float
    jitter: _Jitter = "full"

    def delay(self, retry_index: int, draw: float) -> float:
        """Seconds to wait before retry number ``retry_index`` (1-based), for a uniform
        ``draw`` in ``[0, 1)``."""
        # 2.0 ** 1023 is finite: a long schedule caps at max_s instead of overflowing.
        cap = min(self.max_s, self.initial_s * 2.0 ** min(retry_index - 1, 1023))
        if self.jitter == "equal":
            return cap * (0.5 + 0.5 * draw)
        return cap * draw


class _Wait:
    """``Backoff.delay`` as a tenacity wait strategy, drawing from ``rng``."""

    def __init__(self, backoff: Backoff, rng: random.Random) -> None:
        self.backoff = backoff
        self.rng = rng

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.backoff.delay(retry_state.attempt_number, self.rng.random())


def _failure(state: RetryCallState) -> BaseException:
    outcome = state.outcome
    error = outcome.exception() if outcome is not None else None
    assert error is not None  # tenacity only waits or gives up after a failed try
    return error


def retry(
    backoff: Backoff,
    operation: Callable[[], _Result],
    *,
    retry_if: Callable[[BaseException], bool],
    on_retry: Callable[[BaseException, float], None] | None = None,
    give_up: Callable[[BaseException], NoReturn] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> _Result:
    """``operation()``, tried up to ``backoff.attempts`` times while its error passes
    ``retry_if``. ``on_retry(error, seconds)`` runs before each wait, ``sleep`` waits (it may
    raise to stop waiting, e.g. at shutdown); an error ``retry_if`` refuses is raised as it
    is; when the tries run out, ``give_up(last_error)`` raises (default: the last error)."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt

    def exhausted(state: RetryCallState) -> NoReturn:
        error = _failure(state)
        if give_up is not None:
            give_up(error)
        raise error

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry(_failure(state), state.upcoming_sleep)

    retrying = Retrying(
        stop=stop_after_attempt(backoff.attempts),
        wait=_Wait(backoff, rng or random.Random()),
        retry=retry_if_exception(retry_if),
        before_sleep=before_sleep,
        retry_error_callback=exhausted,
        sleep=sleep,
        reraise=True,
    )
    return retrying(operation)
